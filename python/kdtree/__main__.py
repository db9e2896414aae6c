"""``python -m kdtree`` and the ``kdtree`` console script (pyproject.toml): see :mod:`kdtree.cli`."""

import sys


def main(argv=None) -> int:
    """The command line (``kdtree --help``); returns the exit status."""
    from .apps.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
