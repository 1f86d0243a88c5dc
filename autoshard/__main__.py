"""``python -m autoshard``: the same command line as the ``autoshard`` console script."""

import sys

from autoshard.api.cli import main

if __name__ == "__main__":
    sys.exit(main())
