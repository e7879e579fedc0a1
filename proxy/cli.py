"""`python -m proxy`: the command line.

Subcommands: `explain` (offline: what would happen to these objects, and why).
The agent itself (`python -m proxy [flags]`) arrives with the sync loop.
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m proxy explain [-f FILE]... --node NAME [options]

  explain   show which endpoints each service port gets on a node, and why
            (python -m proxy explain --help for its options)
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "explain":
        from proxy.explain import main as explain_main

        return explain_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    print(f"python -m proxy: unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
