"""Measurements behind the nftables mode's design, one scenario a module:

- `appliers` (`python -m bench.nftables.appliers`): which way to program nf_tables
  natively (`nft -f`, libnftables, pyroute2), by the time of a full load and of one change;
- `conn_cost` (`python -m bench.nftables.conn_cost`): what a new connection pays for the
  mode's shard tables (TCP connects through a lab node, sharded against one table).

The mode's own sync cost, side by side with iptables', is bench/rule_sync.py.
"""
