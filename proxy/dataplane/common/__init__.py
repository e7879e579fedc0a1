"""What every data plane shares: the render context and its one --nodeport-addresses
rule, naming, netlink (generic, rtnetlink, nfnetlink and nf_tables announcements), drift
watchers, the per-family sync skeleton of the rule-based planes, conntrack, paths,
process records and the heap. Nothing here imports a mode.
"""
