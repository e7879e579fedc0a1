"""The kernel's side: the contract (base.py), every mode described once (modes.py), one
mode chosen by name (factory.py), and leftovers of other modes (leftovers.py); what modes
share is in common/ and xtables/, each mode in its own package (docs/architecture.md
gives the import rules)."""
