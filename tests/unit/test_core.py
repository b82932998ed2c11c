"""The decision core (lockd/core/): admission and who a departure wakes, on plain values.

These pin the rules one by one; tests/etcd/test_differential.py checks that the
embedded engine and the etcd backend apply them alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockd.core import (
    BUSY,
    EXCLUSIVE,
    GRANT,
    PARK,
    RETAKE,
    SHARED,
    Refused,
    admit,
    admit_free,
    fits,
    woken,
)


@dataclass(frozen=True)
class Hold:
    mode: str
    limit: int = 1


@dataclass(frozen=True)
class Wanted:
    name: str
    mode: str = EXCLUSIVE
    principal: str = "user:alice"
    owner: str | None = None


def decide(
    mode: str = EXCLUSIVE,
    limit: int = 1,
    *,
    held: tuple[str | None, int] = (None, 0),
    key_limit: int | None = None,
    queued: int = 0,
    own: Hold | None = None,
    blocking: bool = False,
) -> str | Refused:
    return admit(
        "k",
        mode,
        limit,
        held_mode=held[0],
        held_count=held[1],
        key_limit=key_limit,
        queued=queued,
        own_hold=own,
        blocking=blocking,
    )


def test_a_free_key_is_granted() -> None:
    assert decide() == GRANT
    assert decide(SHARED) == GRANT
    assert decide(EXCLUSIVE, 3) == GRANT


def test_try_acquire_needs_room_and_an_empty_queue() -> None:
    assert decide(SHARED, held=(SHARED, 1), key_limit=1) == GRANT
    assert decide(SHARED, held=(SHARED, 1), key_limit=1, queued=1) == BUSY
    assert decide(EXCLUSIVE, held=(SHARED, 1), key_limit=1) == BUSY
    assert decide(EXCLUSIVE, 2, held=(EXCLUSIVE, 1), key_limit=2) == GRANT
    assert decide(EXCLUSIVE, 2, held=(EXCLUSIVE, 2), key_limit=2) == BUSY


def test_a_blocking_acquire_parks_where_a_try_is_busy() -> None:
    assert decide(held=(EXCLUSIVE, 1), key_limit=1, blocking=True) == PARK
    # Nobody overtakes: room, but a waiter before it.
    assert decide(SHARED, held=(SHARED, 2), key_limit=1, queued=1, blocking=True) == PARK


def test_a_retake_wins_even_with_waiters_queued() -> None:
    own = Hold(EXCLUSIVE)
    assert decide(held=(EXCLUSIVE, 1), key_limit=1, queued=3, own=own) == RETAKE
    assert decide(held=(EXCLUSIVE, 1), key_limit=1, queued=3, own=own, blocking=True) == RETAKE


def test_refusals_name_their_field_and_come_first() -> None:
    shared_limit = decide(SHARED, 2)
    assert isinstance(shared_limit, Refused) and shared_limit.field == "limit"
    other_limit = decide(EXCLUSIVE, 3, held=(EXCLUSIVE, 1), key_limit=2)
    assert isinstance(other_limit, Refused) and other_limit.field == "limit"
    assert other_limit.details == {"limit": 2}
    # A re-take in another mode is refused, not taken back.
    other_mode = decide(SHARED, held=(EXCLUSIVE, 1), key_limit=1, own=Hold(EXCLUSIVE))
    assert isinstance(other_mode, Refused) and other_mode.field == "mode"
    assert other_mode.details == {"mode": EXCLUSIVE, "limit": 1}


def test_fits() -> None:
    assert fits(EXCLUSIVE, None, 0, 1)
    assert not fits(EXCLUSIVE, EXCLUSIVE, 1, 1)
    assert fits(SHARED, SHARED, 50, 1)
    assert not fits(SHARED, EXCLUSIVE, 1, 1)
    assert not fits(EXCLUSIVE, SHARED, 1, 1)
    assert fits(EXCLUSIVE, EXCLUSIVE, 2, 3) and not fits(EXCLUSIVE, EXCLUSIVE, 3, 3)


def nobody(principal: str, owner: str) -> bool:
    return False


def test_consecutive_shared_heads_go_together_and_a_writer_stops_them() -> None:
    queue = [Wanted("r1", SHARED), Wanted("r2", SHARED), Wanted("w"), Wanted("r3", SHARED)]
    granted = list(woken(None, 0, 1, queue, holds_owned=nobody))
    assert [w.name for w in granted] == ["r1", "r2"]
    assert list(woken(SHARED, 2, 1, queue[2:], holds_owned=nobody)) == []


def test_a_semaphore_fills_its_free_slots_in_order() -> None:
    queue = [Wanted(f"s{i}") for i in range(4)]
    assert [w.name for w in woken(EXCLUSIVE, 1, 3, queue, holds_owned=nobody)] == ["s0", "s1"]


def test_a_waiter_taking_back_its_principals_hold_takes_no_new_slot() -> None:
    queue = [Wanted("mine", owner="job"), Wanted("other")]

    def alice_job(principal: str, owner: str) -> bool:
        return (principal, owner) == ("user:alice", "job")

    # Two slots of three in use, one of them alice's "job": both fit.
    names = [w.name for w in woken(EXCLUSIVE, 2, 3, queue, holds_owned=alice_job)]
    assert names == ["mine", "other"]
    # Without that hold, "mine" takes the last slot and "other" waits.
    assert [w.name for w in woken(EXCLUSIVE, 2, 3, queue, holds_owned=nobody)] == ["mine"]


def test_the_same_owner_twice_in_one_pass_is_one_slot() -> None:
    queue = [Wanted("a", owner="job"), Wanted("b", owner="job"), Wanted("c")]
    names = [w.name for w in woken(EXCLUSIVE, 0, 2, queue, holds_owned=nobody)]
    assert names == ["a", "b", "c"]


def test_woken_is_lazy_so_a_caller_may_grant_as_it_goes() -> None:
    queue = [Wanted("a", SHARED), Wanted("b", SHARED)]
    seen: list[str] = []

    def heads() -> object:
        for waiter in queue:
            seen.append(waiter.name)
            yield waiter

    gen = woken(None, 0, 1, heads(), holds_owned=nobody)  # type: ignore[arg-type]
    assert next(gen).name == "a" and seen == ["a"]


def test_the_core_imports_nothing_but_itself() -> None:
    """Pure: no trio, no SQLite, nothing of the daemon (a backend imports it, not the reverse)."""
    import subprocess
    import sys

    code = (
        "import sys, lockd.core\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('trio', 'sqlite3')"
        " or (m.startswith('lockd.') and not m.startswith('lockd.core'))]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_admit_free_is_admit_on_a_free_key() -> None:
    for mode in (EXCLUSIVE, SHARED):
        for limit in (1, 2):
            for blocking in (False, True):
                assert admit_free("k", mode, limit) == decide(mode, limit, blocking=blocking)
