"""sliceproxy: a Kubernetes service proxy. The package's layout and import rules are in
docs/architecture.md; `python -m proxy --help` for the agent and its commands."""
