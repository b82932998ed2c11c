"""Assemble the daemon from its parts and run it: what ``lockd serve`` calls.

Start-up refuses rather than guesses: a bad ``lockd.toml``, a rule set that
does not parse, a database of a newer schema, or a live daemon on the socket
path each stop it with one clear line and a non-zero exit.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket as stdsocket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import trio

from lockd.config import BackendSettings, ConfigError, Paths, Settings, load_settings
from lockd.daemon import fdlimit, fencemark, systemd
from lockd.daemon.clock import Clock, SystemClock
from lockd.daemon.engine import LockEngine
from lockd.daemon.listener import (
    SocketInUseError,
    UnsafeSocketDirError,
    acquire_path_lock,
    bind_socket,
    running_daemon,
)
from lockd.daemon.ratelimit import RateLimiter, RuleCpuBudget
from lockd.daemon.remote import RemoteService
from lockd.daemon.rulewatch import watch_rule_sets
from lockd.daemon.runrecord import RunRecord, record_path
from lockd.daemon.server import HANDLED_SIGNALS, Limits, LockServer
from lockd.daemon.service import LockService
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.store import (
    DatabaseDamaged,
    StorageUnavailable,
    Store,
    StoreError,
    read_boot_id,
)
from lockd.identity import IdentityConfig
from lockd.logfmt import kv, setup_logging
from lockd.rules.files import RuleSetError
from lockd.rules.policy import PolicyManager

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend

log = logging.getLogger("lockd.daemon.serve")


class StartupError(Exception):
    """The daemon cannot start; the message says why in one line."""


@dataclass
class Daemon:
    paths: Paths
    settings: Settings
    policy: PolicyManager
    #: None when the lock state lives in etcd (``backend``).
    store: Store | None
    service: LockService
    server: LockServer
    listen_sock: stdsocket.socket
    owns_socket_file: bool
    #: flock held on ``<socket>.lock`` while we serve (None under activation).
    lock_fd: int | None = None

    #: (st_dev, st_ino) of the socket file we bound, to unlink only our own.
    socket_identity: tuple[int, int] | None = None
    backend: EtcdBackend | None = None
    #: why the daemon stopped refusing its database after READY (the check in
    #: the background failed): run() raises it as a refused start.
    refusal: str | None = None

    def close(self) -> None:
        self.listen_sock.close()
        if self.owns_socket_file:
            try:
                st = self.paths.socket.stat()
                if (st.st_dev, st.st_ino) == self.socket_identity:
                    self.paths.socket.unlink()
            except OSError:
                pass
        if self.store is not None:
            self.store.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)


def build(
    paths: Paths,
    *,
    clock: Clock | None = None,
    adopt_fence_mark: bool = False,
    accept_data_loss: bool = False,
    etcd: tuple[str, ...] = (),
) -> Daemon:
    """Load config, rules and database, and take the socket. Raises StartupError.

    ``etcd``: endpoints from ``--etcd``; they make the backend etcd whatever
    ``[backend] kind`` says (its other keys still apply).
    """
    clock = clock or SystemClock()
    # Hold stop/reload signals until the server's receiver runs: the socket
    # answers before then, and a SIGTERM in that window must still mean a
    # clean stop with exit status 0, not death by signal.
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        settings = load_settings(paths.config_dir)
        if etcd:
            settings = replace(settings, backend=settings.backend.with_etcd(etcd))
        if settings.backend.kind == "etcd":
            settings.backend.check_files(str(paths.config_file))
    except ConfigError:
        raise  # exit 2 in the CLI: one line naming the file and the fix
    if not systemd.listen_fd_names():  # under socket activation the socket is ours
        pid = running_daemon(paths.socket)
        if pid is not None:
            raise StartupError(f"a daemon is already running on {paths.socket} (pid {pid})")
    setup_logging(settings.log_level)
    policy = PolicyManager(paths.rule_sets_dir, budget=settings.rule_budget_ms / 1000)
    try:
        policy.load_initial()
    except RuleSetError as exc:
        raise StartupError(f"rule set: {exc}") from None
    backend: EtcdBackend | None = None
    if settings.backend.kind == "etcd":
        # The lock state lives in etcd: no database is opened at all.
        store: Store | None = None
        engine = LockEngine()
        backend = _etcd_backend(settings.backend, clock)
    else:
        store, engine = _open_store(paths, clock, adopt_fence_mark, settings, accept_data_loss)
    service = LockService(
        engine,
        store,
        policy,
        RateLimiter(settings.acquire_per_hour),
        clock,
        stats=StatsRecorder(settings.stats_window),
        max_pending_per_connection=settings.max_pending_per_connection,
        remote=backend,
        break_grace_ms=round(settings.break_grace * 1000),
        rule_cpu=RuleCpuBudget(settings.rule_cpu_ms_per_second),
        max_pending_per_user=settings.max_pending_per_user,
    )
    service.commit()  # leases that ran out while the daemon was down
    if backend is not None:
        remote = service.backend
        assert isinstance(remote, RemoteService)
        backend.on_session_lost = remote.session_lost  # lease-loss events (docs/contract.md §12)
        remote.follow_losses(backend.hold_watch)  # and those made elsewhere
    identity = IdentityConfig(
        daemon_uid=os.getuid(),
        admin_groups=frozenset(settings.admin_groups),
        service_units=frozenset(settings.service_units),
        service_users=frozenset(settings.service_users),
    )
    # Every connection is a descriptor: keep max_connections under the limit,
    # so that clients over it are refused at once instead of left hanging.
    nofile, _hard = fdlimit.raise_soft_limit()
    max_connections = min(settings.max_connections, fdlimit.connection_budget(nofile))
    if max_connections < settings.max_connections:
        log.warning(
            kv(
                event="max_connections_lowered",
                configured=settings.max_connections,
                max_connections=max_connections,
                nofile=nofile,
                reserved=fdlimit.RESERVED_FDS,
                hint="raise LimitNOFILE= (or ulimit -n) or lower max_connections",
            )
        )
    limits = Limits(
        max_connections=max_connections,
        max_line_bytes=settings.max_line_bytes,
        max_connections_per_uid=settings.max_connections_per_uid,
        partial_line_timeout=settings.partial_line_timeout_ms / 1000,
        max_buffered_bytes=settings.max_buffered_bytes,
        # On etcd a request waits milliseconds for the cluster anyway, and a
        # poll would hold up other connections' etcd replies (the poll ends
        # only for client sockets): SQLite only.
        busy_poll_ns=settings.busy_poll_us * 1000 if settings.backend.kind == "sqlite" else 0,
    )
    server = LockServer(service, identity, limits, reload_rules=policy.reload)
    inherited = systemd.listen_fds()
    lock_fd: int | None = None
    if inherited:
        sock, owns = inherited[0], False
        for extra in inherited[1:]:
            extra.close()
    else:
        try:
            lock_fd = acquire_path_lock(paths.socket, paths.socket_mode)
            sock, owns = bind_socket(paths.socket, paths.socket_mode), True
        except (SocketInUseError, UnsafeSocketDirError, OSError) as exc:
            if store is not None:
                store.close()
            if lock_fd is not None:
                os.close(lock_fd)
            if isinstance(exc, SocketInUseError | UnsafeSocketDirError):
                raise StartupError(str(exc)) from None
            raise StartupError(f"socket {paths.socket}: {exc.strerror or exc}") from None
    log.info(
        kv(
            event="started",
            socket=paths.socket if owns else "inherited",
            **_backend_fields(paths, settings, engine),
            config=paths.config_dir,
            max_connections=max_connections,
            nofile=nofile,
            rules=(policy.rules_result()["policy"] or {}).get("file", "open default"),
        )
    )
    daemon = Daemon(paths, settings, policy, store, service, server, sock, owns, lock_fd)
    daemon.backend = backend
    if owns:
        st = paths.socket.stat()
        daemon.socket_identity = (st.st_dev, st.st_ino)
    return daemon


def _open_store(
    paths: Paths,
    clock: Clock,
    adopt_fence_mark: bool,
    settings: Settings,
    accept_data_loss: bool = False,
) -> tuple[Store, LockEngine]:
    """The SQLite database and the engine loaded from it (the embedded backend).

    The run record (lockd.daemon.runrecord) lives in the socket's folder: the
    runtime folder, outside the state folder, for as long as the boot.
    """
    # Loading makes objects per lease (rows, keys; long-lived ones for keys
    # loaded at once): the cyclic collector would walk the growing heap
    # again and again for nothing. _settle_after_ready freezes what is left
    # once the daemon answers.
    gc.disable()
    try:
        # The integrity check runs in a thread, begun after READY: every
        # write waits for it, rows are read only once it passed or checked
        # one by one (Store.leases_of), and a failure stops the daemon
        # (_await_integrity).
        store = Store(
            paths.db,
            read_boot_id(),
            synchronous=settings.sqlite_synchronous,
            background_check=True,
            defer_check=True,  # begun once the daemon answers: _settle_after_ready
            record=RunRecord(record_path(paths.socket.parent, paths.db)),
            accept_loss=accept_data_loss,
            boot_ms=clock.boot_ms,
        )
        adopt = adopt_fence_mark or accept_data_loss
        fence = store.stored_fence()
        if store.mark is not None:
            if adopt:
                store.wait_checked()  # adopting writes the mark: only for a sound database
            try:
                fence = fencemark.check_at_start(store.mark, fence, adopt=adopt)
            except fencemark.FenceMarkError as exc:
                store.wait_checked()  # a damaged file says so rather than "below the mark"
                store.close()
                raise StartupError(f"database: {exc}") from None
        # The record's reservation too: the mark goes when the state folder goes.
        fence = max(fence, store.recorded_fence)
        engine = LockEngine(fence=fence)
        # Each lease's key and deadline only, in chunks after READY (see
        # _restore_rest); the engine reads a key's full rows when it first
        # needs the key, from the first request on (lockd.daemon.cold).
        engine.restore_lazily(store.deadlines_after, store.leases_of)
        # Begins the run record once the check passed (Store.wait_checked).
        store.begin_run(max(fence, store.mark.reserved if store.mark is not None else 0))
        if store.accepted_loss:
            log.warning(
                kv(
                    event="data_loss_accepted",
                    db=paths.db,
                    found=" | ".join(store.accepted_loss),
                    grants_held_ms=max(0, store.grants_held_until - clock.boot_ms()),
                    hint="no key is granted until every lease that may be lost has run out",
                )
            )
    except (StoreError, OSError) as exc:
        raise StartupError(_refusal(exc)) from None
    finally:
        gc.enable()
    return store, engine


def _refusal(exc: BaseException) -> str:
    """The line a start refused on its database ends with (after ``cannot start:``)."""
    return f"database: {exc}. See 'Lost or damaged database' in docs/operations.md"


def _etcd_backend(config: BackendSettings, clock: Clock) -> EtcdBackend:
    # Imported here: the etcd client (h11, ssl) costs the SQLite daemon's start-up for nothing.
    from lockd.daemon.backends.etcd.backend import EtcdBackend
    from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings

    gateway = EtcdGateway(
        GatewaySettings(
            endpoints=config.endpoints,
            timeout=config.etcd_timeout,
            ca_file=config.ca_file,
            cert_file=config.cert_file,
            key_file=config.key_file,
            username=config.username,
            password_file=config.password_file,
        )
    )
    return EtcdBackend(gateway, config, clock)


def _backend_fields(paths: Paths, settings: Settings, engine: LockEngine) -> dict[str, object]:
    """What the start-up log line says about where the lock state lives."""
    config = settings.backend
    if config.kind == "etcd":
        return {
            "backend": "etcd",
            "endpoints": ",".join(config.endpoints),
            "prefix": config.prefix,
            "node": config.node_name,
        }
    # How many leases it holds comes with event=restored, once they are all read.
    return {"db": paths.db, "fence": engine.fence}


#: Seconds between checks that the database files are still ours.
STORE_CHECK_INTERVAL = 0.25


async def _watch_store(store: Store) -> None:
    """Notice the database being deleted or replaced even when nothing is written.

    Writes fail from then on (:meth:`Store.check_files` runs before each);
    this says so loudly, once, and puts the fence mark back (its folder may
    have gone too), so a restart refuses the empty database instead of
    handing out fences again.
    """
    while True:
        await trio.sleep(STORE_CHECK_INTERVAL)
        try:
            store.check_files()
        except StorageUnavailable as exc:
            log.error(kv(event="database_lost", error=exc, effect="no writes until restart"))
            if store.mark is not None and store.mark.reserved:
                try:
                    floor = max(store.mark.floor, store.committed_fence)
                    store.mark.write(store.mark.reserved, floor)
                except OSError as err:
                    log.error(kv(event="fence_mark_lost", error=err.strerror or err))
            return  # the store refuses every write from now on


#: Seconds the restore waits before trying a chunk again after a failed read.
RESTORE_RETRY = 0.25
#: Seconds it waits for pending effects to be committed before its next chunk.
RESTORE_WAIT = 0.001


async def _await_integrity(daemon: Daemon, stop: trio.CancelScope) -> None:
    """Wait for the store's integrity check (in its thread); stop the daemon if it failed.

    The daemon answers while the check runs (restart to ``hello`` does not
    wait for a scan of every row): until it passed, requests that write
    wait for the check in their connections' tasks, facts stay pending,
    and a key's rows are checked as they are read (``Store.leases_of``).
    A failure ends the daemon with the line a refused start prints; the
    requests that waited are never answered.
    """
    store = daemon.store
    assert store is not None
    done = store.check_done
    if done is not None:
        await trio.to_thread.run_sync(done.wait, abandon_on_cancel=True)
    try:
        store.wait_checked()
    except StoreError as exc:
        damaged = isinstance(exc, DatabaseDamaged)
        event = "database_damaged" if damaged else "integrity_check_not_run"
        log.error(kv(event=event, db=store.path, error=exc, effect="lockd stops"))
        daemon.refusal = _refusal(exc) if damaged else f"database: {exc}"
        stop.cancel()
        return
    # What time and departed clients did meanwhile waited for the check
    # (Commits.commit_fact); the requests waiting for it come after, and
    # leases run out again only once they are answered (LockServer.open_gate).
    daemon.service.commit_fact("integrity_checked")
    await daemon.server.open_gate()


async def _restore_rest(service: LockService, checked: trio.Event) -> None:
    """Take up the stored leases a chunk at a time between requests (restore_lazily).

    A chunk is read only when no effect is pending: the engine's view and
    the store's rows agree then (see :meth:`LockEngine.restore_step`). The
    first comes at once (a small database is then restored before the first
    request, as always); the others once the integrity check has passed
    (``checked``): they would take the CPU and the GIL from the check that
    the first write waits for. A chunk holds keys and deadlines only; a
    key's rows are read and checked when it is used.
    """
    engine = service.engine
    started = trio.current_time()
    steps = 0
    while engine.restoring:
        await trio.sleep(0)
        if steps and not checked.is_set():
            await checked.wait()
            continue
        if engine.pending():  # the batch under way is committed first, by its own path
            await trio.sleep(RESTORE_WAIT)
            continue
        try:
            engine.restore_step(service.clock.boot_ms())
            steps += 1
        except StorageUnavailable as exc:
            log.warning(kv(event="storage_unavailable", during="restore", error=exc))
            await trio.sleep(RESTORE_RETRY)
    service.commit_fact("restore")  # leases that ran out while lockd was down
    log.info(
        kv(
            event="restored",
            leases=engine.lease_count,
            keys=engine.held_count,
            seconds=round(trio.current_time() - started, 3),
        )
    )


#: Seconds after READY before the start's deferred work begins: time for
#: the requests queued while the daemon started (the backlog, a first
#: ``hello``) to be answered first (see _settle_after_ready).
SETTLE_AFTER = 0.05


async def _serve(
    daemon: Daemon, everything: trio.CancelScope, task_status: trio.TaskStatus[None]
) -> None:
    """Serve (started once the socket answers and READY is sent); then end the daemon's tasks."""
    await daemon.server.serve(daemon.listen_sock, task_status=task_status)
    if daemon.backend is not None:
        await daemon.backend.close()
    everything.cancel()


async def _settle_after_ready(store: Store | None) -> None:
    """The start's work that the first answers need not wait for, once they are out.

    Restart to the first ``hello`` is the interpreter, the imports and the
    opening of the database; what used to run beside or before it goes
    here, :data:`SETTLE_AFTER` seconds after READY:

    - the integrity check of the whole file begins in its thread (begun
      at the open, it had used ~0.1 s of CPU by ``hello`` at 1 M leases,
      taken from the start on a busy box: the daemon's threads share one
      scheduling group). Nothing is weaker for it: every request that
      writes waits for the check (``LockServer.integrity_checked``),
      facts stay pending until it passed (``Commits.commit_fact``), and a
      row read before it is checked on its own (``Store.leases_of``);
    - a full collection, then the heap frozen out of the collector's way
      (``gc.freeze``): start-up leaves a large heap of long-lived objects
      (modules, the CEL grammar, compiled rules), and request garbage is
      freed by reference counting. Measured ~5-10 % more round trips per
      second; the collection costs ~8-15 ms of CPU.
    """
    await trio.sleep(SETTLE_AFTER)
    if store is not None:
        store.start_check()
    gc.collect()
    gc.freeze()


async def _main(daemon: Daemon) -> None:
    async with trio.open_nursery() as nursery:
        if daemon.store is not None:
            checked = daemon.server.gate_for_check()
            nursery.start_soon(_await_integrity, daemon, nursery.cancel_scope)
            nursery.start_soon(_watch_store, daemon.store)
            nursery.start_soon(_restore_rest, daemon.service, checked)
        if daemon.backend is not None:
            await nursery.start(daemon.backend.run)
        await nursery.start(watch_rule_sets, daemon.paths.rule_sets_dir, daemon.policy.reload)
        # A rule set written between build() and the watch being armed raised
        # no event; look once more now (a no-op when nothing changed).
        daemon.policy.reload()
        await nursery.start(_serve, daemon, nursery.cancel_scope)
        await _settle_after_ready(daemon.store)
    if daemon.backend is not None:
        await daemon.backend.etcd.aclose()


def run(
    paths: Paths,
    *,
    adopt_fence_mark: bool = False,
    accept_data_loss: bool = False,
    etcd: tuple[str, ...] = (),
) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    daemon = build(
        paths, adopt_fence_mark=adopt_fence_mark, accept_data_loss=accept_data_loss, etcd=etcd
    )
    # Let gen-0 run less often: request garbage is freed by reference
    # counting anyway. The heap start-up leaves is frozen out of the
    # collector's way once the daemon answers (_settle_after_ready).
    gc.set_threshold(10_000, 10, 10)
    try:
        trio.run(_main, daemon)
    except BaseExceptionGroup as group:
        refusal = _node_taken(group)
        if refusal is None:
            raise
        raise StartupError(str(refusal)) from None
    finally:
        daemon.close()
    if daemon.refusal is not None:
        raise StartupError(daemon.refusal)
    return 0


def _node_taken(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The etcd backend's NodeTaken, when that alone ended the daemon (nested in task groups)."""
    from lockd.daemon.backends.etcd.nodeclaim import NodeTaken

    matched, rest = group.split(NodeTaken)
    if matched is None or rest is not None:
        return None
    found: BaseException = matched
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found
