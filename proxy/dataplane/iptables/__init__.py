"""The iptables data plane (`--proxy-mode iptables`): `render` (pure: a service port's
chains), `ruleset` (pure: what we applied and the restore text to change it), `apply`
(the DataPlane, through xtables' runners), `iptc_runner` (python-iptables, legacy only).

Nothing is imported here: importing a pure module loads no kernel-facing code.
"""
