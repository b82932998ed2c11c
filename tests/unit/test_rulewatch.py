"""Hot-reload trigger (docs/contract.md §5): every kind of change in rule-sets/ is seen."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from lockd.daemon import rulewatch
from lockd.daemon.rulewatch import watch_rule_sets
from lockd.rules.policy import PolicyManager
from lockd.testing.polling import wait_for_trio

RULES = '[ruleSet]\nname = "p"\nresourceType = "lock"\n[rules.lock]\nacquire = "true"\n'


class Recorder:
    """An ``on_change`` that tests can await."""

    def __init__(self) -> None:
        self.calls = 0
        self._event = trio.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._event.set()

    async def next(self, timeout: float = 1.0) -> None:
        with trio.fail_after(timeout):
            await self._event.wait()
        self._event = trio.Event()

    async def quiet(self, period: float = 0.25) -> None:
        """Assert no call happens for ``period`` seconds of trio's clock.

        The tests that use it run on ``autojump_clock``: the clock jumps only once
        every task is blocked and no I/O is ready, so the watcher has read and
        judged every inotify event the change queued before the period is over,
        and the period costs no real time.
        """
        before = self.calls
        await trio.sleep(period)
        assert self.calls == before


def inotify_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                count += 1
        except OSError:
            pass
    return count


async def start(nursery: trio.Nursery, directory: Path, rec: Recorder, **kw: float) -> None:
    await nursery.start(
        lambda task_status: watch_rule_sets(directory, rec, task_status=task_status, **kw)
    )


async def test_create_edit_rename_delete(tmp_path: Path, autojump_clock: MockClock) -> None:
    d = tmp_path / "rule-sets"
    d.mkdir()
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, d, rec)
        policy = d / "policy.toml"

        policy.write_text(RULES)  # create
        await rec.next()

        with policy.open("a") as f:  # edit in place
            f.write("# edited\n")
        await rec.next()

        tmp = d / "policy.toml.tmp"  # atomic replace, as editors and tools do
        tmp.write_text(RULES + "# v2\n")
        os.replace(tmp, policy)
        await rec.next()

        os.rename(policy, d / "renamed.toml")  # rename within the folder
        await rec.next()

        (d / "renamed.toml").unlink()  # delete
        await rec.next()

        os.chmod(d, 0o755)  # the folder's own metadata is not a rule change
        await rec.quiet(0.15)
        nursery.cancel_scope.cancel()


async def test_burst_is_coalesced(tmp_path: Path, autojump_clock: MockClock) -> None:
    d = tmp_path / "rule-sets"
    d.mkdir()
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, d, rec, settle=0.1)
        for i in range(5):
            (d / f"{i}.toml").write_text(RULES)
            tmp = d / f"{i}.tmp"
            tmp.write_text(RULES)
            os.replace(tmp, d / f"{i}.toml")
        await rec.next()
        await rec.quiet(0.25)
        assert rec.calls == 1
        nursery.cancel_scope.cancel()


async def test_editor_leftovers_do_not_trigger(tmp_path: Path, autojump_clock: MockClock) -> None:
    d = tmp_path / "rule-sets"
    d.mkdir()
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, d, rec)
        for name in (".policy.toml.swp", "policy.toml~", ".hidden.toml", "4913", "notes.txt"):
            (d / name).write_text("x")
            (d / name).unlink()
        await rec.quiet(0.25)
        assert rec.calls == 0
        nursery.cancel_scope.cancel()


async def test_folder_deleted_and_recreated(tmp_path: Path, autojump_clock: MockClock) -> None:
    d = tmp_path / "rule-sets"
    d.mkdir()
    (d / "policy.toml").write_text(RULES)
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, d, rec)
        shutil.rmtree(d)
        await rec.next()
        d.mkdir()
        await rec.next()
        (d / "policy.toml").write_text(RULES)  # the new folder is watched
        await rec.next()
        os.rename(d, tmp_path / "moved-away")
        await rec.next()
        (tmp_path / "moved-away" / "x.toml").write_text(RULES)  # no longer ours
        await rec.quiet(0.2)
        os.rename(tmp_path / "moved-away", d)
        await rec.next()
        (d / "y.toml").write_text(RULES)
        await rec.next()
        nursery.cancel_scope.cancel()


async def test_missing_folder_and_parents(tmp_path: Path, autojump_clock: MockClock) -> None:
    d = tmp_path / "etc" / "lockd" / "rule-sets"
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, d, rec)
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "unrelated").write_text("x")
        await rec.quiet(0.15)
        d.mkdir(parents=True)
        await rec.next()
        (d / "policy.toml").write_text(RULES)
        await rec.next()
        shutil.rmtree(tmp_path / "etc")
        await rec.next()
        d.mkdir(parents=True)
        (d / "policy.toml").write_text(RULES)
        await rec.next()
        nursery.cancel_scope.cancel()


async def test_cancellation_is_prompt_and_closes_the_fd(tmp_path: Path) -> None:
    before = inotify_fds()
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, tmp_path, rec)
        assert inotify_fds() == before + 1
        t = time.perf_counter()
        nursery.cancel_scope.cancel()
    assert time.perf_counter() - t < 1.0  # prompt (watchfiles without a stop event: ~5 s)
    assert inotify_fds() == before


async def test_on_change_errors_are_logged_and_watch_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    done = trio.Event()

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        done.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: watch_rule_sets(tmp_path, flaky, task_status=task_status)
        )
        with caplog.at_level(logging.ERROR, logger="lockd.daemon.rulewatch"):
            (tmp_path / "a.toml").write_text(RULES)
            await wait_for_trio(lambda: calls, 1, "the first (failing) call")
            (tmp_path / "b.toml").write_text(RULES)
            with trio.fail_after(1):
                await done.wait()
        assert any("boom" in (r.exc_text or "") for r in caplog.records)
        nursery.cancel_scope.cancel()


async def test_falls_back_to_polling_without_inotify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_inotify(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(rulewatch, "INotify", no_inotify)
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        await start(nursery, tmp_path, rec, poll_interval=0.05)
        (tmp_path / "policy.toml").write_text(RULES)
        await rec.next()
        (tmp_path / "policy.toml").unlink()
        await rec.next()
        nursery.cancel_scope.cancel()


async def test_drives_policy_manager_reload(tmp_path: Path) -> None:
    d = tmp_path / "rule-sets"
    mgr = PolicyManager(d)
    mgr.load_initial()
    rec = Recorder()

    def reload() -> None:
        mgr.reload()
        rec()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: watch_rule_sets(d, reload, task_status=task_status))
        d.mkdir()
        await rec.next()
        (d / "policy.toml").write_text(RULES.replace('"true"', '"true &&"'))
        await rec.next()
        assert mgr.policy.is_open and mgr.last_error is not None
        assert mgr.last_error["line"] == 5
        (d / "policy.toml").write_text(RULES)
        await rec.next()
        assert mgr.last_error is None and mgr.policy.name == "p"
        shutil.rmtree(d)
        await rec.next()
        assert mgr.policy.is_open
        nursery.cancel_scope.cancel()
