"""The agent's memory by mode, size and situation (`python -m bench.memory`): what a
DaemonSet's memory request and limit must hold.

- `cgroup`: a memory cgroup (v1) the agent and its children run in, as in a container:
  what the kernel charges it (anon, page cache, kernel memory such as the rules it made)
  and its peak, reset between situations, with an optional limit;
- `measure`: one (mode, size): the simulator and the agent in a namespace of their own,
  then a cold start, bursts of changes, a periodic full resync and a restart, each with
  its peak and the steady figure after it;
- `guest`: the same INSIDE the kernel lab (IPVS mode: the host kernel has no IPVS);
- `report`: the Markdown table (what `python -m bench` prints of it);
- `__main__`: the command line, the host / kernel-lab split.
"""

from bench.memory.report import markdown

__all__ = ["markdown"]
