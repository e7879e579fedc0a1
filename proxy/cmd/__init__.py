"""The commands and what they print: `cli` (`python -m proxy`: the agent, `--cleanup`,
and the subcommands), `explain` (offline decisions), `dump_client` (a running agent's
/debug/dump), `kubectl_plugin` (`kubectl sliceproxy`), `termview` (the tables a person
reads) and `demo` (`./run demo`)."""
