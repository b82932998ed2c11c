"""The etcd backend's parts: ``wire`` (gateway messages, no I/O), ``gateway`` (the client)."""
