"""Where lock decisions are committed, when not in the embedded SQLite store.

``etcd/``: many hosts sharing an etcd v3 cluster (SPEC §11). So far the
client and the queue and session building blocks; docs/etcd-design.md is
the design of the backend still to be built on them.
"""
