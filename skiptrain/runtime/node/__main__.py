"""``python -m skiptrain.runtime.node``: see :mod:`skiptrain.runtime.node.main`."""

import sys

from .main import main

if __name__ == "__main__":     # (the fork server's preload imports every module of the package)
    sys.exit(main())
