"""``python -m skiptrain.cli``: the ``skiptrain`` command."""

import sys

from . import main

sys.exit(main())
