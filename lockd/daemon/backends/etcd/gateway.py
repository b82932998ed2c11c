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
  (``_check_leader``): a write forwarded to a dead leader is the commonest
  way to an unknown outcome.
- **No reads from a member that lost its leader.** Every request carries
  etcd's ``hasleader`` metadata (gateway header ``Grpc-Metadata-hasleader``):
  a member cut off from the quorum refuses at once ("no leader") instead of
  serving stale state or waiting out its 7 s proposal timeout, and it ends
  the watches it serves, which then resume on another member.
"""

from __future__ import annotations

import enum
import json
import math
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.transport import (
    HttpFailure,
    MaybeSent,
    NotSent,
    Pool,
    Response,
    StreamingResponse,
)
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
    WatchResponse,
    txn_body,
)

# gRPC status codes etcd answers with (the gateway puts them in "code").
GRPC_CANCELLED = 1
GRPC_UNKNOWN = 2
GRPC_INVALID_ARGUMENT = 3
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_ABORTED = 10
GRPC_UNIMPLEMENTED = 12
GRPC_INTERNAL = 13
GRPC_UNAVAILABLE = 14
GRPC_UNAUTHENTICATED = 16

# etcd errors that mean the request was never proposed to raft: safe to send
# again, to this member later or to another one now.
NOT_PROPOSED = (
    "etcdserver: no leader",
    "etcdserver: too many requests",
    "etcdserver: not capable",
    "etcdserver: unhealthy cluster",
)
INVALID_TOKEN = "etcdserver: invalid auth token"

# gRPC codes with which a member says it could not finish the request, not
# that it refuses it: it may have been proposed (and committed) all the same.
# Code 1 "grpc: the client connection is closing" is what etcd's gateway
# answers while its member shuts down gracefully (SIGTERM); 14 covers
# "request timed out", "leader changed", "server stopped".
INTERRUPTED = frozenset(
    {
        GRPC_CANCELLED,
        GRPC_UNKNOWN,
        GRPC_DEADLINE_EXCEEDED,
        GRPC_ABORTED,
        GRPC_INTERNAL,
        GRPC_UNAVAILABLE,
    }
)
# gRPC codes that mean the request itself was malformed: a bug of ours.
MALFORMED = frozenset({GRPC_INVALID_ARGUMENT, GRPC_UNIMPLEMENTED})


class Failure(enum.Enum):
    """What an etcd error reply means for the request that got it (``classify``)."""

    #: never proposed to raft: send it again, here later or elsewhere now.
    NOT_PROPOSED = "not proposed"
    #: the member gave up on it: it may have been applied (a read may go again).
    OUTCOME_UNKNOWN = "outcome unknown"
    #: etcd's answer stands (a lease gone, no rights, no space): not applied.
    REFUSED = "refused"
    #: the request was malformed: a bug in this client.
    BUG = "bug"


def classify(code: int, message: str, http_status: int) -> Failure:
    """The one place that says what an etcd error reply means (docs/etcd-design.md §8).

    ``code`` is the gRPC code the gateway reports (0 when the reply had
    none), ``http_status`` the HTTP status it came with.
    """
    if message in NOT_PROPOSED or message == INVALID_TOKEN:
        return Failure.NOT_PROPOSED
    if code in INTERRUPTED or (code == 0 and http_status >= 500):
        return Failure.OUTCOME_UNKNOWN
    if code in MALFORMED:
        return Failure.BUG
    return Failure.REFUSED


REQUIRE_LEADER = ("Grpc-Metadata-hasleader", "true")

# One attempt's bound on the answer, within etcd_timeout: a read then tries the
# next member; a write (sent to the leader itself) ends as outcome unknown. A
# healthy member answers in milliseconds (p99 ~0.2 s on the loaded test box).
READ_ATTEMPT = 1.0
WRITE_ATTEMPT = 2.0

# After every endpoint failed in a row, wait before the next round; doubles
# up to the cap, so a cluster that is electing a leader (1-2 s) is not
# flooded, and one that is back is found within a tenth of a second.
BACKOFF_FIRST = 0.02
BACKOFF_CAP = 0.1

# While writes wait for an election to end, one probe per gateway asks the
# members whom they follow this often (a status read: no raft), so the writes
# go out within this long of the new leader, whatever their number. The
# back-off above used to pace each write's own probing: it reached its 0.25 s
# cap within the election and added up to 0.25 s after it (bench/etcd_chaos.py,
# leader kills: 0.09 / 0.23 / 0.40 s median / p90 / max from the new leader to
# the first grant).
LEADER_POLL = 0.05


class NoLiveLeader(NotSent):
    """The member asked follows no leader, or one this client saw die: an election is
    under way, and a write sent now would wait for it inside etcd (or be refused)."""


class EtcdUnavailable(BackendUnavailable):
    """etcd could not be reached, or had no quorum, within the request's bound.

    ``maybe_committed`` is true when a write was possibly applied although no
    answer came back: the caller must look at what it wrote before acting on
    it as failed (for a grant: release it once etcd answers again).
    """

    def __init__(self, message: str, *, maybe_committed: bool = False) -> None:
        super().__init__(message)
        self.maybe_committed = maybe_committed


class EtcdError(Exception):
    """etcd answered and refused the request. As such (not a subclass): the request was
    malformed, a bug of ours (``Failure.BUG``); the daemon answers it INTERNAL."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message


class EtcdRefused(EtcdError, BackendUnavailable):
    """etcd refused a well-formed request (``Failure.REFUSED``): no rights, no space, a
    compacted revision, failed login. Not applied; clients get BACKEND_UNAVAILABLE."""


class LeaseNotFound(EtcdRefused):
    """The lease does not exist (it expired or was revoked)."""


class WatchCompacted(Exception):
    """The watch asked for history etcd has compacted away; read again, then watch anew."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revisions before {compact_revision} are compacted")
        self.compact_revision = compact_revision


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
        # Which member answers at each endpoint (from reply headers), and the
        # members whose endpoint refused a connection since the last leader
        # check: see _check_leader.
        self._member_ids: dict[str, int] = {}
        self._down_members: set[int] = set()
        # Where writes go: the leader's own endpoint, learned from a status
        # reply (None: not known, ask before the next write). Forgotten when a
        # reply's raft term moves on (an election happened) or the leader
        # fails a request. See _write_endpoint.
        self._leader_endpoint: str | None = None
        self._term = 0
        # Set while one call asks the members for a live leader on behalf of
        # every write waiting for one (_leader_elected); None when nobody asks.
        self._leader_probe: trio.Event | None = None
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
        data = body.encode() if isinstance(body, str) else _encode(body)
        deadline = trio.current_time() + self.settings.timeout
        attempts = _Attempts(len(self._endpoints))
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

    async def _call(self, path: str, data: bytes, idempotent: bool, attempts: _Attempts) -> Json:
        """Try the endpoints in turn until one answers (unbounded: ``call`` bounds it)."""
        while True:
            endpoint = self.endpoint
            attempts.maybe_committed = not idempotent
            try:
                if not idempotent:
                    endpoint = await self._write_endpoint(endpoint)
                return await self._post(endpoint, path, data, idempotent=idempotent)
            except NoLiveLeader as failure:
                # Nothing was sent: wait for the election (one probe for all),
                # then go at once to the leader it found.
                attempts.maybe_committed = False
                attempts.last = f"{endpoint}: {failure}"
                await self._leader_elected()
                continue
            except NotSent as failure:
                attempts.maybe_committed = False
                why = str(failure)
                if endpoint == self._leader_endpoint:
                    self._leader_endpoint = None
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

    async def _write_endpoint(self, endpoint: str) -> str:
        """The endpoint a write goes to: the leader's own, whenever it is known.

        A write sent to a follower is forwarded to the leader; if that one
        just died, etcd holds the write up to its 7 s proposal timeout and
        answers with an unknown outcome. Sent to the leader itself, the same
        write finds the connection refused (not sent: try again once a new
        leader is known) or times out after ``WRITE_ATTEMPT`` (the leader is
        then suspect). Learned from a status read (no raft) when unknown,
        after an election (a reply's raft term moved on) or a failure.
        """
        if self._down_members:  # a member was seen down: wait for a live leader
            await self._check_leader(endpoint)
        elif self._leader_endpoint is None:
            try:
                await self._check_leader(endpoint)
            except NoLiveLeader:
                raise  # an election is under way: wait for it rather than send
            except NotSent:
                return endpoint  # who leads is not known: the member forwards it
        return self._leader_endpoint or endpoint

    async def _leader_elected(self) -> None:
        """Return once some member names a live leader (``_leader_endpoint`` is then set, when
        it is one of ours), asking every :data:`LEADER_POLL` seconds.

        One call probes and the other writes waiting for the election wait for
        it, so a leader kill costs the cluster a few status reads per poll,
        not a few per waiting write. Bounded by the caller's deadline; a
        prober cancelled by its own lets the others go, and the next of them
        to find no leader probes.
        """
        probe = self._leader_probe
        if probe is not None:
            await probe.wait()
            return
        self._leader_probe = probe = trio.Event()
        try:
            while not await self._leader_found():
                await trio.sleep(LEADER_POLL)
        finally:
            self._leader_probe = None
            probe.set()

    async def _leader_found(self) -> bool:
        """Ask the members in turn whom they follow (those seen down last); True once one
        names a live leader."""
        down = self._down_members
        for endpoint in sorted(self._endpoints, key=lambda e: self._member_ids.get(e) in down):
            try:
                await self._check_leader(endpoint)
            except NotSent:
                continue
            return True
        return False

    def _suspect(self, endpoint: str) -> None:
        if endpoint in self._member_ids:
            self._down_members.add(self._member_ids[endpoint])
        if endpoint == self._leader_endpoint:
            self._leader_endpoint = None
        self._mark_suspect(endpoint)

    def _mark_suspect(self, endpoint: str) -> None:
        """``endpoint`` failed a request: its watches resume on another member."""
        for watch in list(self._watches.get(endpoint, ())):
            watch.move_on()

    async def _next_endpoint(self, attempts: _Attempts, failure: str) -> None:
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
        # member; a write (to the leader itself, see _write_endpoint) ends
        # as outcome unknown, which its caller resolves from what it wrote.
        if idempotent:
            return min(self.settings.timeout / 2, READ_ATTEMPT)
        return min(self.settings.timeout, WRITE_ATTEMPT)

    async def _check_leader(self, endpoint: str) -> None:
        """Refuse to send a write through a member that still follows a member we saw die.

        After the leader's endpoint refused a connection, the other members
        keep forwarding proposals to it until they elect a new leader
        (~1.5 s), and etcd then holds such a write up to its 7 s proposal
        timeout with an unknown outcome. Asking the member whom it follows
        (a read, no raft) lets the write wait for the election instead, and
        go through as a write whose outcome is known.
        """
        try:
            status = await self._post(endpoint, "/v3/maintenance/status", b"{}", idempotent=True)
        except MaybeSent as failure:  # a read failed: the write itself was never sent
            raise NotSent(str(failure)) from None
        leader = int(status.get("leader", 0))
        if leader in self._down_members and await self._leads_again(leader):
            self._down_members.discard(leader)
        if leader == 0:
            raise NoLiveLeader("no leader yet (an election is under way)")
        if leader in self._down_members:
            raise NoLiveLeader(f"no live leader yet (follows {leader:x}, which is down)")
        self._down_members.clear()  # a new leader: forwarding works again
        self._leader_endpoint = await self._endpoint_of(leader, endpoint)

    async def _endpoint_of(self, member: int, asked: str) -> str | None:
        """Our endpoint of ``member`` (None if it has none among ours)."""
        for endpoint, known in self._member_ids.items():
            if known == member:
                return endpoint
        try:
            doc = await self._post(asked, "/v3/cluster/member/list", b"{}", idempotent=True)
        except (NotSent, MaybeSent):
            return None
        mine = set(self._endpoints)
        for entry in doc.get("members", ()):
            for url in entry.get("clientURLs", ()):
                if str(url).rstrip("/") in mine:
                    self._member_ids[str(url).rstrip("/")] = int(entry.get("ID", 0))
        for endpoint, known in self._member_ids.items():
            if known == member:
                return endpoint
        return None

    async def _leads_again(self, member: int) -> bool:
        """True when ``member``, seen down, answers on its own endpoint and leads.

        A member that was restarted can win the next election before any
        other leader shows up; without asking it, writes would wait for a
        leader outside the down set for as long as it leads.
        """
        for endpoint, known in list(self._member_ids.items()):
            if known != member:
                continue
            try:
                status = await self._post(
                    endpoint, "/v3/maintenance/status", b"{}", idempotent=True
                )
            except (NotSent, MaybeSent):
                return False
            return int(status.get("leader", 0)) == member
        return False

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
            if endpoint in self._member_ids:
                self._down_members.add(self._member_ids[endpoint])
            self._mark_suspect(endpoint)
            raise
        doc = _json(reply.body)
        if reply.status == 200:
            header = doc.get("header")
            if isinstance(header, dict) and "member_id" in header:
                self._member_ids[endpoint] = int(header["member_id"])
                term = int(header.get("raft_term", 0))
                if term > self._term:
                    if self._term:  # an election since: who leads is asked again
                        self._leader_endpoint = None
                    self._term = term
            return doc
        code, message = _error_of(doc, reply)
        if message == INVALID_TOKEN:
            self._token = None  # expired (simple tokens live 5 min idle): log in again
        raise _failure(code, message, reply.status)

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
                        _encode(credentials),
                        (REQUIRE_LEADER,),
                        connect_timeout=self._connect_timeout(),
                    )
                except MaybeSent as failure:  # logging in twice does no harm
                    raise NotSent(f"logging in failed ({failure})") from None
                doc = _json(reply.body)
                if reply.status != 200:
                    code, message = _error_of(doc, reply)
                    refused = _failure(code, message, reply.status)
                    if isinstance(refused, HttpFailure):  # logging in again does no harm
                        raise NotSent(message)
                    raise type(refused)(code, f"login as {self.settings.username!r}: {message}")
                self._token = str(doc["token"])
            return (REQUIRE_LEADER, ("Authorization", self._token))


class Watch:
    """A running watch: ``async for response in watch``; resumes on another endpoint.

    Iteration raises ``WatchCompacted`` when the history it needs is gone,
    ``EtcdUnavailable`` when no endpoint takes the watch back within the
    gateway's timeout, and ``EtcdError`` when etcd refuses it.
    """

    def __init__(self, gateway: EtcdGateway, request: WatchRequest) -> None:
        self._gateway = gateway
        self._request = request
        # The first revision not yet delivered (0: "from now", until the first
        # reply tells us what now is).
        self.next_revision = request.start_revision
        self._response: StreamingResponse | None = None
        self._resumed = False
        self._endpoint: str | None = None  # the member serving it
        self._reading: trio.CancelScope | None = None  # the wait for its next line

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchResponse:
        while True:
            if self._response is None:
                self._response = await self._open()
            self._reading = reading = trio.CancelScope()
            line = None
            try:
                with reading:
                    line = await self._response.next_line()
            except HttpFailure:
                line = None
            finally:
                self._reading = None
            if reading.cancelled_caught:  # its member failed a request: move on
                await self._resume_elsewhere()
                continue
            if line is None:
                await self._resume_elsewhere()  # the member went away
                continue
            if not line.strip():
                continue
            doc = json.loads(line)
            if "error" in doc:  # the member lost its leader (or stops): resume elsewhere
                code, message = _error_of(doc, None)
                failure = _failure(code, message, 0)
                if not isinstance(failure, HttpFailure):
                    raise failure
                await self._resume_elsewhere()
                continue
            response = WatchResponse.parse(doc.get("result", {}))
            if response.compact_revision:
                raise WatchCompacted(response.compact_revision)
            if response.canceled:
                await self._resume_elsewhere()
                continue
            self._advance(response)
            if response.created and self._resumed:
                continue  # the caller saw the watch start once; a resumption is invisible
            return response

    def _advance(self, response: WatchResponse) -> None:
        if response.events:
            self.next_revision = response.events[-1].kv.mod_revision + 1
        elif response.created and self.next_revision == 0:
            # A watch "from now": everything after the revision it started at.
            self.next_revision = response.header.revision + 1

    def move_on(self) -> None:
        """Resume elsewhere at the next chance (its member stopped answering)."""
        if self._reading is not None:
            self._reading.cancel()

    async def _resume_elsewhere(self) -> None:
        await self._drop()
        self._resumed = True
        self._gateway._current = (self._gateway._current + 1) % len(self._gateway._endpoints)

    async def _open(self) -> StreamingResponse:
        """Start the watch on a live endpoint from ``next_revision``, within the timeout."""
        body = self._request.body(start_revision=self.next_revision)
        gateway = self._gateway
        attempts = _Attempts(len(gateway._endpoints))
        with trio.move_on_after(gateway.settings.timeout):
            while True:
                endpoint = gateway.endpoint
                try:
                    response = await self._start(endpoint, body)
                except HttpFailure as failure:
                    await gateway._next_endpoint(attempts, f"{endpoint}: {failure}")
                    continue
                self._endpoint = endpoint
                gateway._watches.setdefault(endpoint, set()).add(self)
                return response
        raise EtcdUnavailable(
            f"no etcd endpoint took the watch within {gateway.settings.timeout:g} s "
            f"(last: {attempts.last})"
        )

    async def _start(self, endpoint: str, body: str) -> StreamingResponse:
        gateway = self._gateway
        headers = await gateway._auth_headers(endpoint)
        # A watch is silent while nothing changes: no read timeout (the
        # caller's bound covers waiting for the response head).
        response = await gateway._http.stream(
            endpoint,
            "/v3/watch",
            body.encode(),
            headers,
            connect_timeout=gateway._connect_timeout(),
        )
        if response.status == 200:
            return response
        try:
            error = await response.read()
        finally:
            await response.aclose()
        code, message = _error_of(_json(error), Response(response.status, response.reason, error))
        if message == INVALID_TOKEN:
            gateway._token = None
        failure = _failure(code, message, response.status)
        if isinstance(failure, HttpFailure):  # a watch changes nothing: start it elsewhere
            raise NotSent(message)
        raise failure

    async def _drop(self) -> None:
        if self._endpoint is not None:
            self._gateway._watches.get(self._endpoint, set()).discard(self)
            self._endpoint = None
        response, self._response = self._response, None
        if response is not None:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def aclose(self) -> None:
        """Cancel the watch (etcd ends it when its connection closes)."""
        await self._drop()


class _Attempts:
    """Failover bookkeeping of one call: back off after each full round of failed endpoints."""

    __slots__ = ("backoff", "endpoints", "failures", "last", "maybe_committed")

    def __init__(self, endpoints: int) -> None:
        self.endpoints = endpoints
        self.failures = 0
        self.backoff = BACKOFF_FIRST
        self.last = "no answer"
        #: the last attempt was a write that may have reached etcd.
        self.maybe_committed = False

    async def after_failure(self) -> None:
        self.failures += 1
        if self.failures % self.endpoints == 0:
            await trio.sleep(self.backoff)
            self.backoff = min(2 * self.backoff, BACKOFF_CAP)


def _encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _json(body: bytes) -> Json:
    try:
        doc = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return {}
    return doc if isinstance(doc, dict) else {}


def _error_of(doc: Mapping[str, Any], reply: Response | None) -> tuple[int, str]:
    """(gRPC code, message) of an error reply, in either of the gateway's two shapes."""
    error = doc.get("error")
    if isinstance(error, dict):  # the shape streams use
        return int(error.get("grpc_code", 0)), str(error.get("message", ""))
    message = doc.get("message") or error
    if not message and reply is not None:
        message = reply.reason or f"HTTP {reply.status}"
    return int(doc.get("code", 0)), str(message)


def _failure(code: int, message: str, http_status: int) -> HttpFailure | EtcdError:
    """The exception for an error reply, as ``classify`` reads it."""
    kind = classify(code, message, http_status)
    if kind is Failure.NOT_PROPOSED:
        return NotSent(message)
    if kind is Failure.OUTCOME_UNKNOWN:
        return MaybeSent(message)
    if kind is Failure.BUG:
        return EtcdError(code, message)
    if code == GRPC_NOT_FOUND and "lease not found" in message:
        return LeaseNotFound(code, message)
    return EtcdRefused(code, message)
