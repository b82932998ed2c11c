"""The daemon's decisions for each op, synchronous and free of sockets.

:class:`LockService` strings together what an ``acquire`` passes through --
policy, rate limit, engine, store -- and formats the wire results. Every
method runs to completion without awaiting, so the engine never sees two
requests interleaved and a commit always precedes the reply built from it.
The trio server (``server.py``) only adds waiting: parked acquires, the
rate-limit wait of a blocking acquire, and the expiry timer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from lockd import __version__
from lockd.daemon.clock import Clock
from lockd.daemon.engine import Busy, Lease, LockEngine, Parked, TimedOut, Waiter
from lockd.daemon.protocol import PROTOCOL_VERSION, ProtocolError, rfc3339_ms
from lockd.daemon.stats import Stats
from lockd.daemon.store import Store
from lockd.identity import Caller
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.service")


class Decision(Protocol):
    @property
    def allowed(self) -> bool: ...

    @property
    def reason(self) -> str: ...


class PolicyLike(Protocol):
    def decide(self, caller: Caller, op: str, key: str) -> Decision: ...

    def rules_result(self) -> dict[str, Any]: ...


class RateLimiterLike(Protocol):
    #: attempts allowed per principal per window.
    limit: int

    def try_take(self, principal: str, now_ms: int) -> int | None: ...


def _denied(op: str, key: str | None, caller: Caller) -> ProtocolError:
    where = f" on key {key!r}" if key is not None else ""
    return ProtocolError(
        "LOCK_ACCESS_DENIED",
        f"{caller.principal} (role {caller.role}) may not {op}{where}",
        details={"op": op, **({"key": key} if key is not None else {})},
    )


class LockService:
    def __init__(
        self,
        engine: LockEngine,
        store: Store,
        policy: PolicyLike,
        ratelimiter: RateLimiterLike,
        clock: Clock,
        stats: Stats | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.policy = policy
        self.ratelimiter = ratelimiter
        self.clock = clock
        self.stats = stats or Stats()
        #: called for each waiter the engine resolved, after the commit.
        self.on_resolved: Callable[[Waiter], None] = lambda waiter: None

    # ----------------------------------------------------------- plumbing

    def commit(self) -> None:
        """Persist the engine's pending effects, then wake resolved waiters."""
        changes = self.engine.drain()
        if not changes:
            return
        try:
            self.store.apply(changes)
        except BaseException:
            # Nothing of the batch is acknowledged: keep it for the next
            # commit (any later request or timer tick retries), and keep its
            # woken waiters parked until then.
            self.engine.undrain(changes)
            raise
        self.stats.count("grants", changes.grants)
        self.stats.count("retakes", changes.retakes)
        for lease in changes.expired:
            self.stats.count("expiries")
            log.info(
                kv(event="expired", key=lease.key, principal=lease.principal, fence=lease.fence)
            )
        for waiter in changes.resolved:
            if waiter.timed_out:
                self.stats.count("timeouts")
            elif waiter.lease is not None and log.isEnabledFor(logging.DEBUG):
                lease = waiter.lease
                log.debug(
                    kv(event="granted", key=lease.key, principal=lease.principal, fence=lease.fence)
                )
            self.on_resolved(waiter)

    def tick(self) -> None:
        """Let time pass in the engine (the expiry timer calls this)."""
        self.engine.advance(self.clock.boot_ms())
        self.commit()

    def authorize(self, caller: Caller, op: str, key: str | None = None) -> None:
        decision = self.policy.decide(caller, op, key or "")
        if not decision.allowed:
            self.stats.count("denials")
            log.info(
                kv(event="denied", op=op, key=key, principal=caller.principal, why=decision.reason)
            )
            raise _denied(op, key, caller)

    # ------------------------------------------------------------ results

    def lease_view(self, lease: Lease) -> dict[str, Any]:
        return {
            "key": lease.key,
            "handle": lease.handle,
            "fence": lease.fence,
            "owner": lease.owner,
            "ttlMs": lease.ttl_ms,
            "leaseExpiresAt": self._wall(lease.expires_at),
        }

    def _wall(self, boot_deadline: int) -> str:
        return rfc3339_ms(self.clock.wall_ms() + boot_deadline - self.clock.boot_ms())

    def status_view(self, key: str, holder: Lease | None, waiters: int) -> dict[str, Any]:
        if holder is None:
            return {
                "key": key,
                "held": False,
                "heldBy": None,
                "owner": None,
                "fence": None,
                "leaseExpiresAt": None,
                "expiresInMs": None,
                "waiters": waiters,
            }
        return {
            "key": key,
            "held": True,
            "heldBy": holder.principal,
            "owner": holder.owner,
            "fence": holder.fence,
            "leaseExpiresAt": self._wall(holder.expires_at),
            "expiresInMs": max(0, holder.expires_at - self.clock.boot_ms()),
            "waiters": waiters,
        }

    # ---------------------------------------------------------------- ops

    def hello(self, caller: Caller) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "principal": caller.principal,
            "role": caller.role,
            "uid": caller.uid,
            "pid": caller.pid,
        }

    def rate_counted(self, caller: Caller) -> bool:
        """Owners and services are not counted by the rate limit (SPEC 6)."""
        return caller.role not in ("owner", "service")

    def take_attempt(self, caller: Caller) -> int | None:
        """Count one acquire attempt; the ms to wait for room when over limit."""
        if not self.rate_counted(caller):
            return None
        return self.ratelimiter.try_take(caller.principal, self.clock.boot_ms())

    def rate_limited(self, retry_after_ms: int) -> ProtocolError:
        self.stats.count("rateLimited")
        return ProtocolError(
            "RATE_LIMITED",
            f"too many acquire attempts; retry in {retry_after_ms} ms",
            details={"retryAfterMs": retry_after_ms, "limit": self.ratelimiter.limit},
        )

    def acquire(
        self,
        caller: Caller,
        conn: int,
        key: str,
        *,
        ttl_ms: int,
        owner: str | None,
        release_on_close: bool,
        wait_ms: int | None,
    ) -> Lease | Busy | Parked | TimedOut:
        result = self.engine.acquire(
            self.clock.boot_ms(),
            key,
            ttl_ms=ttl_ms,
            principal=caller.principal,
            owner=owner,
            conn=conn,
            release_on_close=release_on_close,
            wait_ms=wait_ms,
        )
        self.commit()
        if isinstance(result, Lease):
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    kv(event="granted", key=key, principal=caller.principal, fence=result.fence)
                )
        elif isinstance(result, TimedOut):
            self.stats.count("timeouts")
        return result

    def renew(self, caller: Caller, key: str, handle: str, ttl_ms: int) -> dict[str, Any]:
        self.authorize(caller, "renew", key)
        lease = self.engine.renew(self.clock.boot_ms(), key, handle, ttl_ms)
        self.commit()
        if lease is None:
            return {"renewed": False, "reason": "lease_lost"}
        self.stats.count("renewals")
        return {"renewed": True, "leaseExpiresAt": self._wall(lease.expires_at)}

    def release(self, caller: Caller, key: str, handle: str) -> dict[str, Any]:
        released = self.engine.release(self.clock.boot_ms(), key, handle)
        self.commit()
        if not released:
            return {"released": False, "reason": "not_holder"}
        self.stats.count("releases")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(kv(event="released", key=key, principal=caller.principal))
        return {"released": True}

    def release_undelivered(self, lease: Lease) -> None:
        """A grant whose reply could not be written is released at once."""
        if self.engine.release(self.clock.boot_ms(), lease.key, lease.handle):
            self.stats.count("releases")
            log.info(kv(event="released_undelivered", key=lease.key, principal=lease.principal))
        self.commit()

    def connection_closed(self, conn: int, *, release_bound: bool = True) -> None:
        now = self.clock.boot_ms()
        for lease in self.engine.connection_closed(now, conn, release_bound=release_bound):
            self.stats.count("releases")
            log.debug(kv(event="released_on_close", key=lease.key, principal=lease.principal))
        self.commit()

    def cancel_waiter(self, waiter: Waiter) -> None:
        self.engine.cancel_waiter(self.clock.boot_ms(), waiter)
        self.commit()

    def status(self, key: str) -> dict[str, Any]:
        st = self.engine.status(self.clock.boot_ms(), key)
        self.commit()
        return self.status_view(st.key, st.holder, st.waiters)

    def list(self, caller: Caller, prefix: str, limit: int | None) -> dict[str, Any]:
        self.authorize(caller, "list")
        held = self.engine.list_held(self.clock.boot_ms(), prefix, limit)
        self.commit()
        return {"locks": [self.status_view(s.key, s.holder, s.waiters) for s in held]}

    def break_lock(self, caller: Caller, key: str, reason: str) -> dict[str, Any]:
        self.authorize(caller, "break", key)
        broken = self.engine.break_lock(self.clock.boot_ms(), key)
        self.commit()
        if broken is None:
            log.info(kv(event="break_free_key", key=key, by=caller.principal, reason=reason))
            return {"broken": False}
        self.stats.count("breaks")
        log.warning(
            kv(
                event="broken",
                key=key,
                by=caller.principal,
                holder=broken.principal,
                fence=broken.fence,
                reason=reason,
            )
        )
        return {
            "broken": True,
            "heldBy": broken.principal,
            "owner": broken.owner,
            "fence": broken.fence,
        }

    def rules(self, caller: Caller) -> dict[str, Any]:
        self.authorize(caller, "rules")
        return self.policy.rules_result()
