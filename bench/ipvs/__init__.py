"""The IPVS benchmark, in the kernel lab (`python -m bench.ipvs`): pyroute2 against our own
netlink client, and what an IpvsDataPlane sync costs, in a real Linux kernel.

- `run`: the host side: boots the lab's kernel once per size, runs `guest` in it, checks
  and reports (`run`, `failed_checks`, `markdown`, the command line);
- `guest`: the measurements, run as a script INSIDE the guest (never on the host);
- `clients`: the two netlink clients compared, behind one interface (kernel-touching);
- `workload`: the N x M table both clients and the data plane must build (pure).

Nothing is imported here: the guest loads only what it runs.
"""
