"""Unit tests: no daemon process, no etcd (in-process servers, fakes and stubs)."""
