"""The daemon: the only program in lockd that runs trio, SQLite and CEL.

Layers, bottom up (each may import only the ones before it):

- ``engine`` (lock semantics) and ``protocol`` (wire format) are pure: no I/O,
  no trio, time passed in as an argument.
- ``store`` (SQLite), ``ratelimit``, ``stats``, ``clock``: state at the edges.
- ``service``: one synchronous decision per request (access, rate limit,
  engine, commit, reply).
- ``server``, ``sockio``, ``listener``, ``systemd``, ``rulewatch``: trio I/O.
- ``serve``: assembles the above for ``lockd serve``.

This ``__init__`` imports nothing, so ``import lockd.daemon.engine`` stays free
of trio.
"""
