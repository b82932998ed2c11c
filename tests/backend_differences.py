"""Where the etcd backend may differ from SQLite: the one list (docs/contract.md §11).

A test marked ``both_backends`` runs once per backend. Wherever its
expectation depends on the backend, it names one of these entries, and only
through them:

- ``backend.differs("NAME")`` in a test body: True on the backend that
  differs (etcd), False on SQLite; an unknown name fails the test;
- the helpers of ``tests.conftest.Backend`` that compute an expectation
  (``effective_ttl_ms``, ``fence_follows``) consult their entry the same way;
- ``@pytest.mark.differs("NAME")`` on a test that checks something etcd does
  not do at all (an entry with ``etcd_skips=True``): its etcd run is
  reported as skipped, naming the entry.

A test whose etcd run fails because of a bug (the contract holds on etcd
too) is no difference: ``@pytest.mark.etcd_bug("what")`` expects its etcd run
to fail, strictly, until the bug is fixed.

Nothing else in ``tests/`` asks which backend it runs on
(``test_backend_differences.py`` checks it). ``sqlite_only(reason)`` stays for
tests that are not about a difference at all: the code under test never
reaches the store (roles, the rate limit, the request parser), or running it
twice would only repeat the same requests.

docs/contract.md §11 shows this list as its table of allowed differences;
``test_backend_differences.py`` checks the two agree word for word. After
changing an entry, ``python -m tests.backend_differences`` prints the table
to paste there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    """One way the etcd backend is allowed to answer other than SQLite."""

    name: str
    #: what a caller sees on etcd, against SQLite
    differs: str
    #: why the contract allows it (the section that says so)
    why: str
    #: etcd does not do this at all: a test marked ``differs(name)`` skips its etcd run
    etcd_skips: bool = False
    #: no test meets it yet (so none names it); a test that does clears this
    untested: bool = False


DIFFERENCES: dict[str, Difference] = {
    entry.name: entry
    for entry in (
        Difference(
            "whole_second_ttl",
            "A grant's effective `ttlMs` is rounded up to a whole second, and at least "
            "2 s; SQLite keeps it to the millisecond.",
            'etcd leases count whole seconds (§11 "TTLs count whole seconds").',
        ),
        Difference(
            "fence_revisions",
            "Fences are etcd revisions: strictly increasing, but they skip numbers; "
            "on SQLite each grant's fence is the previous one plus 1.",
            '§1: fences strictly increase, not consecutively; §11 "Fences are etcd revisions".',
        ),
        Difference(
            "expiry_ends_in_etcd",
            "An expired hold ends when etcd ends its lease, which may be a moment after "
            "`leaseExpiresAt`; no daemon sees it run out, so the `expiries` counter "
            "does not move.",
            '§11: `leaseExpiresAt` reads as "not before", and etcd, not a daemon, ends leases.',
        ),
        Difference(
            "handoff_follows_release",
            "`release` (or a waiter's leaving) answers before the next waiter's grant "
            "is committed: the waiter's own daemon grants once its watch sees the "
            "key free, a moment later.",
            '§11 "The queue spans hosts": the head may wait on another host\'s '
            "daemon, which learns of the release only through etcd.",
        ),
        Difference(
            "held_is_null",
            "`stats` reports `held` as null (so OpenMetrics has no `lockd_held` "
            "sample); `waiters` and `fence` are the daemon's own.",
            "§11: every host shares the keys; no daemon counts every host's holds.",
        ),
        Difference(
            "node_field",
            "`status`, `list` and every `holders` entry add `node`, the host whose "
            "daemon granted the hold; every `waiterList` entry, the waiter's host.",
            '§11 "Where things are per host"; §12.2.',
        ),
        Difference(
            "session_ends_release_on_close",
            "A daemon killed with SIGKILL takes its `releaseOnClose` holds with its "
            "etcd session (its restart ends the old session at once); on SQLite they "
            "stay as TTL holds across the restart.",
            '§11 "Session lease": a dead daemon\'s `releaseOnClose` holds end with its session.',
        ),
        Difference(
            "no_deadlock_detection",
            "A blocking `acquire` that closes a cycle of waits is not refused with "
            "`DEADLOCK`: it waits until its timeout.",
            "§12.3: cycles through the etcd backend are not seen.",
            etcd_skips=True,
        ),
        Difference(
            "rule_cpu_refuses_waits",
            "A member past its rule CPU share gets `RATE_LIMITED` for a blocking "
            "`acquire` too, where SQLite lets it wait within its `timeoutMs`.",
            "§6, rule CPU per caller.",
            untested=True,
        ),
    )
}


def difference(name: str) -> Difference:
    """The entry called ``name``; a name not in the list is a mistake in the test."""
    try:
        return DIFFERENCES[name]
    except KeyError:
        raise KeyError(
            f"{name!r} is no allowed backend difference (tests/backend_differences.py): "
            f"one of {sorted(DIFFERENCES)}"
        ) from None


#: The header of the table in docs/contract.md §11.
TABLE_HEADER = (
    "| Name | What differs on etcd | Why it is allowed |",
    "|---|---|---|",
)


def table_rows() -> list[str]:
    """The §11 table's rows, one per entry, in the order of ``DIFFERENCES``."""
    return [f"| `{d.name}` | {d.differs} | {d.why} |" for d in DIFFERENCES.values()]


if __name__ == "__main__":
    print("\n".join([*TABLE_HEADER, *table_rows()]))
