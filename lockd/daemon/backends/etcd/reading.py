"""What ``status`` and ``list`` read from etcd: a key's directory, held keys a page at a time.

Plain reads, no decision: the directory of one key as etcd holds it, and
``list``'s pages, read in chunks all at one revision so a page is one
consistent picture of every host's holds.
"""

from __future__ import annotations

from lockd.daemon.backends import RemoteStatus
from lockd.daemon.backends.etcd.gateway import EtcdGateway
from lockd.daemon.backends.etcd.records import Directory, Layout
from lockd.daemon.backends.etcd.wire import KeyValue, RangeOp, prefix_end
from lockd.daemon.waiterview import MAX_LISTED_WAITERS

#: records read per range while paging ``list``.
LIST_CHUNK = 512


class DirectoryReader:
    """Reads keys' directories for ``status`` and ``list`` (:class:`EtcdBackend`'s views)."""

    def __init__(self, etcd: EtcdGateway, layout: Layout) -> None:
        self.etcd = etcd
        self.layout = layout

    async def read(self, key: str) -> Directory:
        result = await self.etcd.range(RangeOp(self.layout.directory(key), prefix=True))
        return Directory.parse(self.layout, key, result.kvs, result.header.revision)

    async def status(self, key: str) -> RemoteStatus:
        directory = await self.read(key)
        return remote_status(key, directory)

    async def list_held(
        self, prefix: str, limit: int, after: str | None
    ) -> tuple[list[RemoteStatus], str | None]:
        """Held keys under ``prefix`` in key order after ``after``, at most ``limit``.

        Reads the records from the first candidate key on, in chunks, all at
        the first chunk's revision, until it has ``limit`` + 1 held keys (to
        know whether more remain): a page costs its own records.
        """
        layout = self.layout
        low = layout.locks + prefix.encode().hex().encode()
        high = prefix_end(low)
        start = max(low, layout.after(after)) if after is not None else low
        revision = 0
        page: list[RemoteStatus] = []
        current: str | None = None
        records: list[KeyValue] = []

        def flush() -> None:
            if current is not None:
                directory = Directory.parse(layout, current, records, revision)
                if directory.holds:
                    page.append(remote_status(current, directory))

        while len(page) <= limit:
            read = RangeOp(start, range_end=high, limit=LIST_CHUNK, revision=revision)
            result = await self.etcd.range(read)
            revision = revision or result.header.revision
            for record in result.kvs:
                key = layout.lock_key(record.key)
                if key != current:
                    flush()
                    current, records = key, []
                records.append(record)
            if not result.more:
                flush()
                break
            start = result.kvs[-1].key + b"\0"
        if len(page) > limit:
            return page[:limit], page[limit - 1].key
        return page, None


def remote_status(key: str, directory: Directory) -> RemoteStatus:
    """status/list's view of a key: holders, the waiter count and the first waiters."""
    queued = [w.queued() for w in directory.waiters[:MAX_LISTED_WAITERS]]
    return RemoteStatus(key, directory.holds, len(directory.waiters), queued)
