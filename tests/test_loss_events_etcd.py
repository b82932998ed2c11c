"""Lease-loss events on the etcd backend (docs/contract.md §11, §12): the end of the session.

A ``releaseOnClose`` hold lives on the daemon's etcd session; when etcd
ends that session (an outage past its TTL, here a revoke of its lease),
the hold is gone and its listening holder is told ``cause: "session"``.
Breaks and re-takes on etcd are tested with the embedded backend's tests
(``test_loss_events_live``, both backends).
"""

from __future__ import annotations

import base64
import socket
from pathlib import Path

from lockd.daemon.backends.etcd.records import Layout
from tests.conftest import DaemonProcess
from tests.etcd_cluster import EtcdBackend, EtcdCluster
from tests.test_protocol_live import RawConn


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _session_lease(cluster: EtcdCluster, backend: EtcdBackend) -> str:
    """The daemon's session lease: the one its node-name claim is written on."""
    claim = Layout(backend.prefix).node(backend.node or socket.gethostname())
    reply = cluster.members[0].post("/v3/kv/range", {"key": _b64(claim)}, timeout=5)
    assert reply is not None and reply.get("kvs"), reply
    lease = reply["kvs"][0]["lease"]  # type: ignore[index]
    assert isinstance(lease, str)
    return lease


def test_a_lost_session_tells_the_bound_holder(etcd_cluster: EtcdCluster, short_tmp: Path) -> None:
    backend = EtcdBackend.on(etcd_cluster, session_ttl=2)
    daemon = DaemonProcess.in_folder(short_tmp, backend)
    daemon.start()
    try:
        holder = RawConn(daemon.socket)
        hello = holder.call({"id": 0, "op": "hello", "events": True})
        assert hello["result"]["events"] is True
        bound = holder.call(
            {"id": 1, "op": "tryAcquire", "key": "s", "ttlMs": 60000, "releaseOnClose": True}
        )["result"]
        ttl_only = holder.call({"id": 2, "op": "tryAcquire", "key": "t", "ttlMs": 60000})["result"]
        lease = _session_lease(etcd_cluster, backend)
        assert (
            etcd_cluster.members[0].post("/v3/lease/revoke", {"ID": lease}, timeout=5) is not None
        )
        event = holder.reply(timeout=30)  # the session keeper looks every third of its TTL
        assert event["event"] == "lost" and event["cause"] == "session"
        assert event["handle"] == bound["handle"] and event["by"] is None
        # The TTL hold does not live on the session: it stays, and is not told.
        renewed = holder.call(
            {"id": 3, "op": "renew", "key": "t", "handle": ttl_only["handle"], "ttlMs": 60000}
        )
        assert renewed["result"]["renewed"] is True
    finally:
        daemon.terminate()
