"""`python -m bench.reflector_fleet`."""

import sys

from bench.reflector_fleet.cli import main

if __name__ == "__main__":
    sys.exit(main())
