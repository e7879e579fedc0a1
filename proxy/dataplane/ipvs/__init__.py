"""The IPVS data plane (`--proxy-mode ipvs`): virtual servers over netlink, service
addresses on a dummy interface, ipsets and a few fixed iptables rules. `render`, `index`,
`diff` and `netfilter` are pure; `netlink`, `kernel` and `drift` talk to the kernel;
`apply` is the DataPlane, handing out its jobs: `virtual_servers` (the IPVS table),
`drain` (real servers that drain), `dummy_interface` (its addresses) and
`ipsets_iptables` (the ipset and iptables side).

Nothing is imported here: the pure modules load without pyroute2.
"""
