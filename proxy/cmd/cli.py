"""`python -m proxy`: the command line.

    python -m proxy [flags]            run the agent (kube-proxy's flags; --help lists them)
    python -m proxy --cleanup [flags]  remove sliceproxy's rules from this node and exit
    python -m proxy --init-only [flags]  set kube-proxy's node settings (sysctls) and exit
    python -m proxy --restore-node-settings  give the node back what --init-only changed
    python -m proxy explain ...        offline: what would happen to these objects, and why
    python -m proxy dump [ADDRESS]     ask a running agent (its /debug/dump)
"""

from __future__ import annotations

import sys

from proxy.config.options import ConfigError, parse_args

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "explain":
        from proxy.cmd.explain import main as explain_main

        return explain_main(args[1:])
    if args and args[0] == "dump":
        from proxy.cmd.dump_client import main as dump_main

        return dump_main(args[1:])
    try:
        config = parse_args(args)
    except ConfigError as exc:
        print(f"python -m proxy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    given = [flag for flag, on in (("--init-only", config.init_only),
                                   ("--cleanup", config.cleanup),
                                   ("--restore-node-settings", config.restore_node_settings))
             if on]
    if len(given) > 1:
        print(f"python -m proxy: {' and '.join(given)}: give one", file=sys.stderr)
        return EXIT_USAGE
    if config.init_only or config.restore_node_settings:
        from proxy.agent.node_setup import init_only, restore_only

        return init_only(config) if config.init_only else restore_only(config)
    # Imported here so `explain` and `--help` stay quick and need no agent dependencies.
    from proxy.agent.main import cleanup, run

    if config.cleanup:
        return cleanup(config)
    return run(config)
