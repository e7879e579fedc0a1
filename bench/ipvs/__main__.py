"""`python -m bench.ipvs`."""

import sys

from bench.ipvs.run import main

if __name__ == "__main__":
    sys.exit(main())
