"""pytest fixtures for a real etcd cluster (lockd/testing/etcd_cluster.py).

Registered as a plugin from ``tests/conftest.py``. They skip with a reason
when ``etcd`` is not installed; CI installs it in ``.ci/run``, so there they run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest

from lockd.testing.etcd_cluster import ETCD, OPENSSL, EtcdCluster, TlsFiles, data_root


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """One 3-member cluster for the whole run: tests that use it leave every member running.

    Tests that kill members, or need TLS or authentication, take
    ``new_etcd_cluster`` instead.
    """
    _require_etcd()
    root = data_root()
    cluster = EtcdCluster(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def new_etcd_cluster() -> Iterator[Callable[..., EtcdCluster]]:
    """Start clusters for this test alone: ``new_etcd_cluster(size=3, tls=False)``.

    Every cluster it started is killed and its data removed after the test.
    """
    _require_etcd()
    root = data_root()
    clusters: list[EtcdCluster] = []

    def start(size: int = 3, *, tls: bool = False) -> EtcdCluster:
        if tls and OPENSSL is None:
            pytest.skip("openssl is not installed (needed to make test certificates)")
        folder = root / f"c{len(clusters)}"
        files = TlsFiles.make(folder / "tls") if tls else None
        cluster = EtcdCluster(folder, size=size, tls=files)
        clusters.append(cluster)
        return cluster.start()

    try:
        yield start
    finally:
        for cluster in clusters:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _require_etcd() -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
