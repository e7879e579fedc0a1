import sys

from proxy.cmd.cli import main

try:
    sys.exit(main())
except BrokenPipeError:  # `python -m proxy explain ... | head` is fine
    sys.exit(0)
