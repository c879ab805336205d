"""The unit layer: tests that start no process (``tests/unit/conftest.py`` enforces it).

A package, so that its ``conftest.py`` is imported as ``unit.conftest`` and does not take the
module name ``conftest`` from ``tests/conftest.py``, whose helpers tests import with ``from
conftest import ...``; and so that the integration tests of a split file can import the helpers
they share with its units (``from unit.test_runtime_units import ...``).  ``tests/`` is on
``sys.path`` through pytest's default ("prepend") import of ``tests/conftest.py``.
"""
