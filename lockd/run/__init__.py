"""``lockd run``: hold a key while a command runs.

The supervisor talks to the daemon only through ``lockd_client`` and imports
nothing from ``lockd.daemon``: options, taking the lease and the process group
handling live here.
"""
