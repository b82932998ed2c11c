"""A first end-to-end check: the real daemon, the real client."""

from __future__ import annotations

import pytest
from lockd_client import LockClient, LockTimeoutError

from lockd.testing.daemon import DaemonProcess

pytestmark = pytest.mark.both_backends


def test_acquire_wait_release_roundtrip(daemon: DaemonProcess) -> None:
    with LockClient(str(daemon.socket)) as client:
        handle = client.acquire("portfolio-import:42", ttl=60, timeout=10)
        assert client.status("portfolio-import:42").held
        with pytest.raises(LockTimeoutError) as info:
            client.acquire("portfolio-import:42", ttl=60, timeout=0.05)
        assert info.value.timeout_ms == 50
        assert client.release(handle).released
        assert not client.status("portfolio-import:42").held


def test_sigterm_exits_zero(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
