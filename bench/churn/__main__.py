"""`python -m bench.churn`."""

import sys

from bench.churn.cli import main

if __name__ == "__main__":
    sys.exit(main())
