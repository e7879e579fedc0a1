"""The native nftables data plane (`--proxy-mode nftables`): our own `ip sliceproxy` and
`ip6 sliceproxy` tables, verdict-map dispatch, one chain per service port. `render` and
`transaction` are pure; `expressions` and `wire` encode rules into netlink; `runner`
talks to the kernel (and to nft for what the encoder does not speak); `apply` is the
DataPlane.

Nothing is imported here: the pure modules load without libnftables or netlink.
"""
