"""A test bed of network namespaces: a node (where the agent and its rules live), a
client outside it, and backend pods answering with their names. Used by the e2e tests,
the kernel-lab (QEMU) tests and the demo; never touches the host's namespace. poll.py is
the one wait-with-deadline helper of tests, benchmarks and the demo.
"""

from proxy.netns_lab.topology import Backend, BackendSpec, Lab, LabError, sweep_stale

__all__ = ["Backend", "BackendSpec", "Lab", "LabError", "sweep_stale"]
