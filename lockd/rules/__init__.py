"""Access rules: TOML rule-set files, the CEL environment, and the decision.

Used by the daemon (``lockd.daemon``) and by ``lockd rules check|test``; it
imports nothing from the daemon and no trio.
"""
