"""`python -m bench.rolling_update`."""

import sys

from bench.rolling_update.cli import main

if __name__ == "__main__":
    sys.exit(main())
