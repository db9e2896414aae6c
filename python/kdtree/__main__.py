"""``python -m kdtree``: see :mod:`kdtree.cli`."""

import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
