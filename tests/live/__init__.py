"""Live tests: a real ``lockd serve`` on SQLite (``both_backends``: on etcd too)."""
