"""A running etcd watch that resumes on another endpoint (``EtcdGateway.watch``).

It is part of the etcd client: it sends through the gateway's connection
pool and credentials, moves the gateway on to the next endpoint when its
member fails, and is registered with the gateway per endpoint, so a member
that stops answering requests has its watches moved at once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd.failures import (
    INVALID_TOKEN,
    Attempts,
    EtcdUnavailable,
    WatchCompacted,
    error_of,
    failure_of,
    json_doc,
)
from lockd.daemon.backends.etcd.transport import (
    HttpFailure,
    NotSent,
    Response,
    StreamingResponse,
)
from lockd.daemon.backends.etcd.wire import WatchRequest, WatchResponse

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.gateway import EtcdGateway


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
                code, message = error_of(doc, None)
                failure = failure_of(code, message, 0)
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
        attempts = Attempts(len(gateway._endpoints))
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
        code, message = error_of(json_doc(error), Response(response.status, response.reason, error))
        if message == INVALID_TOKEN:
            gateway._token = None
        failure = failure_of(code, message, response.status)
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
