"""What ``status`` and ``list`` show of the engine's keys, loaded or cold.

Read-only views of the engine (:mod:`lockd.daemon.engine`): a key's
holders and first waiters (:class:`~lockd.daemon.leases.KeyStatus`), and
pages of held keys in key order (:class:`~lockd.daemon.leases.ListPage`),
merging the loaded keys' sorted index with the cold keys', which are shown
from their stored rows without being loaded for good. They are separate
because they change no lock state (only a key that ran out while the timer
is behind is settled before it is shown, as any request would).
"""

from __future__ import annotations

import heapq
import itertools

from lockd.daemon.coldpath import ColdPath, by_key
from lockd.daemon.expiry import Expiry
from lockd.daemon.keytable import KeyState, KeyTable, holders, queued
from lockd.daemon.leases import MAX_LISTED_HOLDERS, KeyStatus, Lease, ListPage
from lockd.daemon.waiterview import MAX_LISTED_WAITERS


def key_status(key: str, state: KeyState | None) -> KeyStatus:
    """What ``status`` shows of a loaded key (``state``), or of a free one (None)."""
    if state is None:
        return KeyStatus(key, None, None, 0, [], 0)
    listed = list(itertools.islice(holders(state), MAX_LISTED_HOLDERS))
    queue = list(itertools.islice(queued(state), MAX_LISTED_WAITERS))
    return KeyStatus(key, state.mode, state.limit, state.count, listed, state.q_len, queue)


def cold_status(group: list[Lease]) -> KeyStatus:
    """What status shows of a cold key, from its stored leases (as restore makes it)."""
    group.sort(key=lambda lease: lease.fence)  # oldest grant first
    newest = group[-1]
    return KeyStatus(
        newest.key, newest.mode, newest.limit, len(group), group[:MAX_LISTED_HOLDERS], 0
    )


def list_page(
    table: KeyTable,
    coldpath: ColdPath,
    expiry: Expiry,
    now: int,
    prefix: str,
    limit: int,
    after: str | None,
) -> ListPage:
    """Held keys under ``prefix`` in key order, at most ``limit``, after ``after``.

    The caller has taken up every chunk of a restore and applied the due
    deadlines it could (:meth:`LockEngine.list_held`). Keys under a prefix
    are contiguous in key order, so the page is a slice of the sorted index
    (merged with the cold keys', read in one call): O(limit + log n). While
    the timer is behind, each key is settled first and skipped if that
    freed it.
    """
    if after is not None and after >= prefix:
        cursor, inclusive = after, False
    else:
        cursor, inclusive = prefix, True
    keys: list[str] = []
    #: cold keys of the page -> their stored leases.
    cold_rows: dict[str, list[Lease]] = {}
    exhausted = False
    while not exhausted and len(keys) <= limit:
        # A batch first: settling a key may take it out of the index.
        want = limit + 1 - len(keys)
        hot = table.sorted_keys.irange(minimum=cursor, inclusive=(inclusive, True))
        cold = list(itertools.islice(coldpath.cold.keys_from(cursor, inclusive), want))
        batch = list(itertools.islice(heapq.merge(hot, cold), want))
        in_cold = set(cold)
        exhausted = len(batch) < want
        if batch:
            cursor, inclusive = batch[-1], False
        for at, key in enumerate(batch):
            if not key.startswith(prefix):
                exhausted = True
                del batch[at:]
                break
        loaded = coldpath.load([k for k in batch if k in in_cold]) if in_cold else ()
        for group in by_key(loaded):
            key = group[0].key
            if expiry.behind and any(lease.expires_at <= now for lease in group):
                # ran out: to the engine, to be settled below
                coldpath.adopt_outside_requests(group)
            else:
                cold_rows[key] = group
        for key in batch:
            if key in cold_rows:
                keys.append(key)
                continue
            if expiry.behind:
                expiry.settle(now, key)
            if key in table.keys:
                keys.append(key)
    more = len(keys) > limit
    del keys[limit:]
    held = table.keys
    return ListPage(
        [key_status(k, held[k]) if k in held else cold_status(cold_rows[k]) for k in keys],
        keys[-1] if more else None,
    )
