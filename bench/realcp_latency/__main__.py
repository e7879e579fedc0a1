"""`python -m bench.realcp_latency`."""

import sys

from bench.realcp_latency.cli import main

if __name__ == "__main__":
    sys.exit(main())
