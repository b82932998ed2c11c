"""An etcd v3 client for the daemon: etcd's JSON gateway over HTTP/1.1, under trio.

Why this shape:

- **The JSON gateway** is served by etcd on its client port (3.4+), so no
  gRPC stack is needed. The HTTP under it is ``transport.py``: a strict
  HTTP/1.1 parser of its own (``http1.py``) on non-blocking sockets, a few
  kept connections per endpoint, TLS with client certificates by
  ``trio.SSLStream``, watches streamed line by line. It costs a fraction of
  the CPU httpx did per call (the daemon's limit on lockd-on-etcd's
  throughput), and it says exactly whether a failed request may have reached
  etcd, which the failover rules below rest on.
- **One bound per request.** Every call, failover included, ends within
  ``timeout`` (the config's ``etcd_timeout``); when it cannot, it raises
  ``EtcdUnavailable``, which the daemon answers as ``BACKEND_UNAVAILABLE``.
- **Failover without double effects.** A request goes to the endpoint that
  answered last; on a failure it moves to the next. Reads move on after any
  failure. A write moves on only when it certainly did not reach etcd (the
  connection was refused, or etcd said it has no leader, so nothing was
  proposed); when a write may have been committed (the connection broke after
  sending, etcd timed out the proposal, the deadline struck mid-request) it
  raises ``EtcdUnavailable(maybe_committed=True)`` at once, so the caller can
  find out what happened from the keys it wrote, instead of the client
  guessing by retrying. After it saw a member's endpoint refuse connections,
  it sends a write only through a member that no longer follows that one
  (``Leadership.check`` in ``leader.py``): a write forwarded to a dead leader
  is the commonest way to an unknown outcome.
- **No reads from a member that lost its leader.** Every request carries
  etcd's ``hasleader`` metadata (gateway header ``Grpc-Metadata-hasleader``):
  a member cut off from the quorum refuses at once ("no leader") instead of
  serving stale state or waiting out its 7 s proposal timeout, and it ends
  the watches it serves, which then resume on another member.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from lockd.daemon.backends.etcd.failures import (
    GRPC_NOT_FOUND,
    INVALID_TOKEN,
    Attempts,
    EtcdError,
    EtcdRefused,
    EtcdUnavailable,
    Failure,
    LeaseNotFound,
    NoLiveLeader,
    WatchCompacted,
    classify,
    encode_body,
    error_of,
    failure_of,
    json_doc,
)
from lockd.daemon.backends.etcd.leader import LEADER_POLL, Leadership
from lockd.daemon.backends.etcd.transport import HttpFailure, MaybeSent, NotSent, Pool
from lockd.daemon.backends.etcd.watch import Watch
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    DeleteResult,
    Json,
    KeyLike,
    LeaseGrant,
    LeaseTimeToLive,
    Op,
    PutOp,
    PutResult,
    RangeOp,
    RangeResult,
    TxnResult,
    WatchRequest,
    txn_body,
)

# What the etcd client raises, and the reading of etcd's errors, live in
# failures.py; they are the client's, so they are importable from here too.
__all__ = [
    "GRPC_NOT_FOUND",
    "LEADER_POLL",
    "EtcdError",
    "EtcdGateway",
    "EtcdRefused",
    "EtcdUnavailable",
    "Failure",
    "GatewaySettings",
    "LeaseNotFound",
    "Watch",
    "WatchCompacted",
    "classify",
]

REQUIRE_LEADER = ("Grpc-Metadata-hasleader", "true")

# One attempt's bound on the answer, within etcd_timeout: a read then tries the
# next member; a write (sent to the leader itself) ends as outcome unknown. A
# healthy member answers in milliseconds (p99 ~0.2 s on the loaded test box).
READ_ATTEMPT = 1.0
WRITE_ATTEMPT = 2.0


@dataclass(frozen=True)
class GatewaySettings:
    """How to reach the cluster; the ``[backend]`` table of ``lockd.toml`` maps onto this."""

    endpoints: Sequence[str]
    timeout: float = 5.0  # etcd_timeout: the bound on one call, failover included
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: at least one etcd URL is needed")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError("etcd_timeout must be a positive number of seconds")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if (self.username is None) != (self.password_file is None):
            raise ValueError("username and password_file go together")

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS setup for https endpoints: our CA (else the system's) and client certificate."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def password(self) -> str:
        assert self.password_file is not None
        return self.password_file.read_text().rstrip("\r\n")


class EtcdGateway:
    """The daemon's etcd client. Use as ``async with EtcdGateway(settings) as etcd:``."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._endpoints = [e.rstrip("/") for e in settings.endpoints]
        self._current = 0  # the endpoint that answered last
        self._token: str | None = None
        # Who leads, where writes go, the wait for an election (leader.py).
        self._leader = Leadership(self._endpoints, self._post)
        # The running watches per endpoint: a member that stops answering
        # requests (stopped, cut off) has its watches moved elsewhere at
        # once (_mark_suspect), as a silent watch would miss every event.
        self._watches: dict[str, set[Watch]] = {}
        self._auth_lock = trio.Lock()
        tls = any(e.startswith("https:") for e in self._endpoints)
        # Each watch holds a connection of its own for as long as it runs.
        self._http = Pool(settings.ssl_context() if tls else None)

    async def __aenter__(self) -> EtcdGateway:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to first."""
        return self._endpoints[self._current]

    # --- key-value ---------------------------------------------------------------

    async def range(self, op: RangeOp) -> RangeResult:
        return RangeResult.parse(await self.call("/v3/kv/range", op.body(), idempotent=True))

    async def get(self, key: KeyLike) -> RangeResult:
        return await self.range(RangeOp(key))

    async def put(self, key: KeyLike, value: KeyLike, *, lease: int = 0) -> PutResult:
        body = PutOp(key, value, lease=lease, prev_kv=True).body()
        return PutResult.parse(await self.call("/v3/kv/put", body, idempotent=False))

    async def delete(self, op: DeleteOp) -> DeleteResult:
        doc = await self.call("/v3/kv/deleterange", op.body(), idempotent=False)
        return DeleteResult.parse(doc)

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """One atomic transaction: if every compare holds run ``success``, else ``failure``.

        A transaction with no ops at all is one etcd answers from the
        member's own copy, like a ``serializable`` read (its server counts a
        txn as serializable when every op in it is a serializable range,
        which no ops satisfies vacuously). Sent to a follower, it saw the
        store from before a put already acknowledged (measured: 128 of 2,000
        under load). So such a transaction carries one linearizable
        count-only read in ``failure``, whose reply is dropped: the compare
        is then decided on a quorum read like every other one.
        """
        bare = not success and not failure and compares
        if bare:
            failure = (RangeOp(compares[0].key, count_only=True),)
        body = txn_body(compares, success, failure)
        read_only = all(isinstance(op, RangeOp) for op in (*success, *failure))
        result = TxnResult.parse(await self.call("/v3/kv/txn", body, idempotent=read_only))
        if bare:
            result.responses.clear()
        return result

    # --- leases --------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> LeaseGrant:
        """A new lease of ``ttl`` seconds (etcd raises it to its minimum, 2 s on 3.4)."""
        # Not idempotent: a lost reply leaves a lease behind, which expires by itself.
        doc = await self.call("/v3/lease/grant", {"TTL": str(ttl)}, idempotent=False)
        return LeaseGrant.parse(doc)

    async def lease_keepalive(self, lease_id: int) -> int:
        """Refresh the lease to its granted TTL; return that TTL. LeaseNotFound if it is gone."""
        doc = await self.call("/v3/lease/keepalive", {"ID": str(lease_id)}, idempotent=True)
        result = doc.get("result", {})
        ttl = int(result.get("TTL", 0))
        if ttl <= 0:  # the gateway answers an unknown lease with no TTL, not an error
            raise LeaseNotFound(GRPC_NOT_FOUND, f"lease {lease_id:x} not found")
        return ttl

    async def lease_revoke(self, lease_id: int) -> None:
        """End the lease now and delete every key attached to it. LeaseNotFound if gone."""
        # Revoking twice has the same effect as once: a retry is harmless.
        await self.call("/v3/lease/revoke", {"ID": str(lease_id)}, idempotent=True)

    async def lease_time_to_live(self, lease_id: int, *, keys: bool = False) -> LeaseTimeToLive:
        body: Json = {"ID": str(lease_id), "keys": keys}
        return LeaseTimeToLive.parse(await self.call("/v3/lease/timetolive", body, idempotent=True))

    # --- cluster -------------------------------------------------------------------

    async def status(self) -> Json:
        """``/v3/maintenance/status`` of whichever member answers (version, leader, revision)."""
        return await self.call("/v3/maintenance/status", "{}", idempotent=True)

    # --- watches -------------------------------------------------------------------

    @asynccontextmanager
    async def watch(self, request: WatchRequest) -> AsyncIterator[Watch]:
        """A watch from ``request.start_revision``; iterate it for ``WatchResponse``s.

        The watch survives the loss of the member serving it: it resumes on
        another endpoint from the revision after the last one it delivered,
        so no event is lost or repeated. Leaving the block cancels it.
        """
        watch = Watch(self, request)
        try:
            yield watch
        finally:
            await watch.aclose()

    # --- the transport ------------------------------------------------------------

    async def call(self, path: str, body: Mapping[str, Any] | str, *, idempotent: bool) -> Json:
        """POST ``body`` (a document, or JSON text) to ``path`` on a live endpoint; the reply's
        JSON document.

        Raises ``EtcdUnavailable`` when no endpoint answered within
        ``settings.timeout`` (or a write's outcome is unknown), ``EtcdError``
        when etcd refused the request.
        """
        data = body.encode() if isinstance(body, str) else encode_body(body)
        deadline = trio.current_time() + self.settings.timeout
        attempts = Attempts(len(self._endpoints))
        if trio.current_effective_deadline() <= deadline:
            # The caller's bound ends first (in the daemon, every request's
            # does): it cancels this call before a bound of ours could end
            # it, so one more cancel scope would bound nothing, and it costs
            # as much CPU as reading the reply.
            return await self._call(path, data, idempotent, attempts)
        with trio.CancelScope(deadline=deadline):
            return await self._call(path, data, idempotent, attempts)
        raise EtcdUnavailable(
            f"etcd did not answer within {self.settings.timeout:g} s (last: {attempts.last})",
            maybe_committed=attempts.maybe_committed,
        )

    async def _call(self, path: str, data: bytes, idempotent: bool, attempts: Attempts) -> Json:
        """Try the endpoints in turn until one answers (unbounded: ``call`` bounds it)."""
        while True:
            endpoint = self.endpoint
            attempts.maybe_committed = not idempotent
            try:
                if not idempotent:
                    endpoint = await self._leader.write_endpoint(endpoint)
                return await self._post(endpoint, path, data, idempotent=idempotent)
            except NoLiveLeader as failure:
                # Nothing was sent: wait for the election (one probe for all),
                # then go at once to the leader it found.
                attempts.maybe_committed = False
                attempts.last = f"{endpoint}: {failure}"
                await self._leader.elected()
                continue
            except NotSent as failure:
                attempts.maybe_committed = False
                why = str(failure)
                if endpoint == self._leader.endpoint:
                    self._leader.endpoint = None
            except MaybeSent as failure:
                if not idempotent:
                    # The leader did not answer in time (stopped, or cut off):
                    # the next write asks who leads before it goes anywhere.
                    self._suspect(endpoint)
                    raise EtcdUnavailable(
                        f"{endpoint}: {failure}; the write may have been applied",
                        maybe_committed=True,
                    ) from None
                why = str(failure)
                self._mark_suspect(endpoint)
            await self._next_endpoint(attempts, f"{endpoint}: {why}")

    def _suspect(self, endpoint: str) -> None:
        if endpoint in self._leader.member_ids:
            self._leader.down_members.add(self._leader.member_ids[endpoint])
        if endpoint == self._leader.endpoint:
            self._leader.endpoint = None
        self._mark_suspect(endpoint)

    def _mark_suspect(self, endpoint: str) -> None:
        """``endpoint`` failed a request: its watches resume on another member."""
        for watch in list(self._watches.get(endpoint, ())):
            watch.move_on()

    async def _next_endpoint(self, attempts: Attempts, failure: str) -> None:
        """Move on to the next endpoint; after a whole round of failures, back off first."""
        attempts.last = failure
        self._current = (self._current + 1) % len(self._endpoints)
        await attempts.after_failure()

    def _connect_timeout(self) -> float:
        # A connect should take well under a millisecond: a slow one means a
        # host that is gone, and the budget is better spent on the next
        # endpoint.
        return self.settings.timeout / (len(self._endpoints) + 1)

    def _read_timeout(self, *, idempotent: bool) -> float:
        # Shorter than the budget, so a stopped or cut-off member costs one
        # attempt, not the whole etcd_timeout: a read then goes to the next
        # member; a write (to the leader itself, see Leadership.write_endpoint) ends
        # as outcome unknown, which its caller resolves from what it wrote.
        if idempotent:
            return min(self.settings.timeout / 2, READ_ATTEMPT)
        return min(self.settings.timeout, WRITE_ATTEMPT)

    async def _post(self, endpoint: str, path: str, data: bytes, *, idempotent: bool) -> Json:
        """One attempt; ``NotSent``/``MaybeSent`` for failures another endpoint may not have."""
        headers = await self._auth_headers(endpoint)
        try:
            reply = await self._http.request(
                endpoint,
                path,
                data,
                headers,
                connect_timeout=self._connect_timeout(),
                read_timeout=self._read_timeout(idempotent=idempotent),
            )
        except NotSent:  # the transport raises it only when no connection could be made
            if endpoint in self._leader.member_ids:
                self._leader.down_members.add(self._leader.member_ids[endpoint])
            self._mark_suspect(endpoint)
            raise
        doc = json_doc(reply.body)
        if reply.status == 200:
            header = doc.get("header")
            if isinstance(header, dict) and "member_id" in header:
                self._leader.member_ids[endpoint] = int(header["member_id"])
                term = int(header.get("raft_term", 0))
                if term > self._leader.term:
                    if self._leader.term:  # an election since: who leads is asked again
                        self._leader.endpoint = None
                    self._leader.term = term
            return doc
        code, message = error_of(doc, reply)
        if message == INVALID_TOKEN:
            self._token = None  # expired (simple tokens live 5 min idle): log in again
        raise failure_of(code, message, reply.status)

    async def _auth_headers(self, endpoint: str) -> tuple[tuple[str, str], ...]:
        if self.settings.username is None:
            return (REQUIRE_LEADER,)
        async with self._auth_lock:
            if self._token is None:
                credentials = {"name": self.settings.username, "password": self.settings.password()}
                try:
                    reply = await self._http.request(
                        endpoint,
                        "/v3/auth/authenticate",
                        encode_body(credentials),
                        (REQUIRE_LEADER,),
                        connect_timeout=self._connect_timeout(),
                    )
                except MaybeSent as failure:  # logging in twice does no harm
                    raise NotSent(f"logging in failed ({failure})") from None
                doc = json_doc(reply.body)
                if reply.status != 200:
                    code, message = error_of(doc, reply)
                    refused = failure_of(code, message, reply.status)
                    if isinstance(refused, HttpFailure):  # logging in again does no harm
                        raise NotSent(message)
                    raise type(refused)(code, f"login as {self.settings.username!r}: {message}")
                self._token = str(doc["token"])
            return (REQUIRE_LEADER, ("Authorization", self._token))
