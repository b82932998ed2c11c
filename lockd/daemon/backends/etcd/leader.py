"""Who leads the etcd cluster, as the client knows it: where writes go (docs/etcd-design.md §8).

A write sent to a follower is forwarded to the leader; a write forwarded to
a dead leader is the commonest way to an unknown outcome. So the client
learns the leader's own endpoint from status reads (no raft), forgets it
when a reply's raft term moves on or the leader fails a request, and after
it saw a member's endpoint refuse connections sends writes only through a
member that no longer follows that one. While an election is under way,
one probe asks for the new leader on behalf of every waiting write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio

from lockd.daemon.backends.etcd.failures import NoLiveLeader
from lockd.daemon.backends.etcd.transport import MaybeSent, NotSent
from lockd.daemon.backends.etcd.wire import Json

# While writes wait for an election to end, one probe per gateway asks the
# members whom they follow this often (a status read: no raft), so the writes
# go out within this long of the new leader, whatever their number. The
# back-off between rounds (failures.py) used to pace each write's own probing: it reached its 0.25 s
# cap within the election and added up to 0.25 s after it (bench/etcd_chaos.py,
# leader kills: 0.09 / 0.23 / 0.40 s median / p90 / max from the new leader to
# the first grant).
LEADER_POLL = 0.05


class Post(Protocol):
    """One attempt of a request to one endpoint (``EtcdGateway._post``)."""

    async def __call__(
        self, endpoint: str, path: str, data: bytes, *, idempotent: bool
    ) -> Json: ...


class Leadership:
    """Which member leads and at which of our endpoints; the wait for an election."""

    def __init__(self, endpoints: Sequence[str], post: Post) -> None:
        self._endpoints = endpoints
        self._post = post
        # Which member answers at each endpoint (from reply headers), and the
        # members whose endpoint refused a connection since the last leader
        # check: see check.
        self.member_ids: dict[str, int] = {}
        self.down_members: set[int] = set()
        # Where writes go: the leader's own endpoint, learned from a status
        # reply (None: not known, ask before the next write). Forgotten when a
        # reply's raft term moves on (an election happened) or the leader
        # fails a request. See write_endpoint.
        self.endpoint: str | None = None
        self.term = 0
        # Set while one call asks the members for a live leader on behalf of
        # every write waiting for one (elected); None when nobody asks.
        self._probe: trio.Event | None = None

    async def write_endpoint(self, endpoint: str) -> str:
        """The endpoint a write goes to: the leader's own, whenever it is known.

        A write sent to a follower is forwarded to the leader; if that one
        just died, etcd holds the write up to its 7 s proposal timeout and
        answers with an unknown outcome. Sent to the leader itself, the same
        write finds the connection refused (not sent: try again once a new
        leader is known) or times out after ``WRITE_ATTEMPT`` (the leader is
        then suspect). Learned from a status read (no raft) when unknown,
        after an election (a reply's raft term moved on) or a failure.
        """
        if self.down_members:  # a member was seen down: wait for a live leader
            await self.check(endpoint)
        elif self.endpoint is None:
            try:
                await self.check(endpoint)
            except NoLiveLeader:
                raise  # an election is under way: wait for it rather than send
            except NotSent:
                return endpoint  # who leads is not known: the member forwards it
        return self.endpoint or endpoint

    async def elected(self) -> None:
        """Return once some member names a live leader (``endpoint`` is then set, when
        it is one of ours), asking every :data:`LEADER_POLL` seconds.

        One call probes and the other writes waiting for the election wait for
        it, so a leader kill costs the cluster a few status reads per poll,
        not a few per waiting write. Bounded by the caller's deadline; a
        prober cancelled by its own lets the others go, and the next of them
        to find no leader probes.
        """
        probe = self._probe
        if probe is not None:
            await probe.wait()
            return
        self._probe = probe = trio.Event()
        try:
            while not await self._found():
                await trio.sleep(LEADER_POLL)
        finally:
            self._probe = None
            probe.set()

    async def _found(self) -> bool:
        """Ask the members in turn whom they follow (those seen down last); True once one
        names a live leader."""
        down = self.down_members
        for endpoint in sorted(self._endpoints, key=lambda e: self.member_ids.get(e) in down):
            try:
                await self.check(endpoint)
            except NotSent:
                continue
            return True
        return False

    async def check(self, endpoint: str) -> None:
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
        if leader in self.down_members and await self._leads_again(leader):
            self.down_members.discard(leader)
        if leader == 0:
            raise NoLiveLeader("no leader yet (an election is under way)")
        if leader in self.down_members:
            raise NoLiveLeader(f"no live leader yet (follows {leader:x}, which is down)")
        self.down_members.clear()  # a new leader: forwarding works again
        self.endpoint = await self._endpoint_of(leader, endpoint)

    async def _endpoint_of(self, member: int, asked: str) -> str | None:
        """Our endpoint of ``member`` (None if it has none among ours)."""
        for endpoint, known in self.member_ids.items():
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
                    self.member_ids[str(url).rstrip("/")] = int(entry.get("ID", 0))
        for endpoint, known in self.member_ids.items():
            if known == member:
                return endpoint
        return None

    async def _leads_again(self, member: int) -> bool:
        """True when ``member``, seen down, answers on its own endpoint and leads.

        A member that was restarted can win the next election before any
        other leader shows up; without asking it, writes would wait for a
        leader outside the down set for as long as it leads.
        """
        for endpoint, known in list(self.member_ids.items()):
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
