"""etcd tests: a real etcd cluster (lockd.testing.etcd_cluster) is needed."""
