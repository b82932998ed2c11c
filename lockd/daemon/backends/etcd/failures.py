"""What etcd's error replies mean, and what the etcd client raises (docs/etcd-design.md §8).

``classify`` is the one place that reads an error reply; the exceptions
here are what :class:`~lockd.daemon.backends.etcd.gateway.EtcdGateway` and
its watches raise (the gateway module re-exports them). ``Attempts`` counts
one call's failover rounds.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.transport import HttpFailure, MaybeSent, NotSent, Response
from lockd.daemon.backends.etcd.wire import Json

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


# After every endpoint failed in a row, wait before the next round; doubles
# up to the cap, so a cluster that is electing a leader (1-2 s) is not
# flooded, and one that is back is found within a tenth of a second.
BACKOFF_FIRST = 0.02
BACKOFF_CAP = 0.1


class Attempts:
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


def encode_body(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def json_doc(body: bytes) -> Json:
    try:
        doc = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return {}
    return doc if isinstance(doc, dict) else {}


def error_of(doc: Mapping[str, Any], reply: Response | None) -> tuple[int, str]:
    """(gRPC code, message) of an error reply, in either of the gateway's two shapes."""
    error = doc.get("error")
    if isinstance(error, dict):  # the shape streams use
        return int(error.get("grpc_code", 0)), str(error.get("message", ""))
    message = doc.get("message") or error
    if not message and reply is not None:
        message = reply.reason or f"HTTP {reply.status}"
    return int(doc.get("code", 0)), str(message)


def failure_of(code: int, message: str, http_status: int) -> HttpFailure | EtcdError:
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
