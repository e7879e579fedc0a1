"""x_tables through its tools, shared by the modes that write iptables rules (iptables,
and IPVS for its few fixed chains): `restore_runner` runs iptables-save/-restore on the
host's back end, `saved` reads and writes their text, `cleanup` removes our chains,
`simulate` is an in-memory x_tables that pure tests (and the corpus) apply rules to.
"""
