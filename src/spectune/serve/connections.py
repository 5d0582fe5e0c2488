"""The server's connections: no peer that is idle, trickles its headers or its body, or never authenticates can
hold a place a caller needs.

uvicorn counts every open connection against `limit_concurrency` and answers 503 in plain text past it, so 64 sockets
that send nothing lock every caller out, /health included. spectune turns that limit off (the app bounds the requests
in progress itself) and bounds the connections here instead:

- a request's headers must arrive within `header_timeout` of its start, the first on a connection and every later one
  on a kept-alive connection (a slowloris trickling bytes resets uvicorn's keep-alive timer, not this one);
- its body within `body_timeout` of its headers: past it the caller gets a JSON 408 and the connection closes;
- an answer sent before its request's body was all read (401, 413) closes the connection at once;
- past `max_connections`, a new connection closes the oldest one that holds no request in progress (idle, awaiting
  headers, or trickling a body), so hostile connections make room for a caller instead of shutting it out: first
  those that never showed the API key, idle ones before uploads; an upload that showed the key is never closed for
  room (an upload closed so gets a JSON 503 first);
- `max_connections` fits the process's open-file limit (`fit_connections`): past it, accepting fails before any
  eviction can run and every caller, /health included, is reset.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from spectune.errors import SpectuneError
from spectune.serve.refusal import authorized, error_body

# The scope key that tells the app what the connection already answered a request it cut (status, message, type):
# the route's own answer can no longer be sent, but /metrics counts the request as answered so.
CUT_BY_SERVER = "spectune.cut_by_server"
# Descriptors kept for everything but clients: the models' files, logs, the listening socket, llama.cpp's threads.
DESCRIPTOR_RESERVE = 64


def fit_connections(requested: int, explicit: bool) -> tuple[int, int]:
    """(the connection cap, the open-file limit): the soft limit raised as far as the hard one allows, the cap kept
    below what is left of it after the descriptors already open and DESCRIPTOR_RESERVE. A cap the user set that
    cannot fit is refused, naming both numbers; the default is lowered to fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, requested + 4 * DESCRIPTOR_RESERVE)
    if soft != resource.RLIM_INFINITY and wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # a hard limit past the kernel's nr_open: keep the soft one
            pass
    if soft == resource.RLIM_INFINITY:
        return requested, soft
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    room = soft - in_use - DESCRIPTOR_RESERVE
    if requested <= room:
        return requested, soft
    if explicit or room < 2:
        raise SpectuneError(
            f"--max-connections {requested}: the open-file limit is {soft} (hard {hard}) with {in_use} open, which "
            f"leaves room for {max(room, 0)} connections; lower --max-connections or raise the limit (ulimit -n)"
        )
    return room, soft


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the limits above (a subclass per server sets the class attributes)."""

    header_timeout = 10.0
    body_timeout = 10.0
    max_connections = 1024
    api_key: str | None = None  # a connection whose request showed it is a caller's, not a stranger's
    closed_by_server: Callable[[str], None] = staticmethod(lambda reason: None)  # counts each close by reason
    arrivals = itertools.count()  # the order connections came in (the oldest makes room first)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.opened = next(self.arrivals)
        self.body_deadline: Any = None
        self.timed_body: Any = None  # the request cycle whose body is being timed
        self.keyed = False  # a request on it showed the API key
        self._await_headers()
        self._make_room()

    def holds_no_request(self) -> bool:
        """Idle, awaiting headers, or still receiving a body: what a new connection may push out."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def uploading(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and cycle.more_body

    def _make_room(self) -> None:
        if len(self.connections) <= self.max_connections:
            return
        others = [
            c for c in self.connections if c is not self and c.holds_no_request() and not (c.keyed and c.uploading())
        ]
        if not others:  # every other connection carries a request in progress: this one waits for none of them
            self._close(self, "full")
            return
        oldest = min(others, key=lambda c: (c.keyed, c.uploading(), c.opened))
        if oldest.uploading():
            oldest._refuse(503, "closed to make room for other connections; retry", "server_busy", "evicted")
        else:
            self._close(oldest, "evicted")

    def _close(self, connection: GuardedH11, reason: str) -> None:
        if not connection.transport.is_closing():
            connection.transport.close()
            self.closed_by_server(reason)

    def _await_headers(self) -> None:
        self.awaited_after = self.cycle  # the request before the one whose headers are awaited
        self.header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not self.awaited_after:  # its headers are in: its body and answer have their own limits
            self.header_deadline.cancel()
            if self.api_key and cycle is not None and not self.keyed:
                headers = dict(cycle.scope["headers"])
                self.keyed = authorized(headers.get(b"authorization", b"").decode("latin-1"), self.api_key)
            if cycle is not None and cycle is not self.timed_body and cycle.more_body:
                self.timed_body = cycle
                self.body_deadline = self.loop.call_later(self.body_timeout, self._body_too_slow, cycle)

    def on_response_complete(self) -> None:
        answered = self.cycle
        super().on_response_complete()
        self.header_deadline.cancel()
        if answered is not None and answered.more_body:  # answered before its body came: nothing more to read
            self._close(self, "answered_before_body")
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self.header_deadline.cancel()
        if self.body_deadline is not None:
            self.body_deadline.cancel()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        if self.cycle is self.awaited_after:
            self._close(self, "header_timeout")

    def _body_too_slow(self, cycle: Any) -> None:
        if cycle is self.cycle and self.uploading():
            message = f"the request body did not arrive within {self.body_timeout:g} s"
            self._refuse(408, message, "request_timeout", "body_timeout")

    def shutdown(self) -> None:
        """uvicorn's graceful stop: an upload still coming is answered 503 and closed now, not at its body timeout."""
        if self.uploading():
            self._refuse(503, "the server is shutting down", "server_shutting_down", "shutdown")
        else:
            super().shutdown()

    def _refuse(self, status: int, message: str, kind: str, reason: str) -> None:
        """Answer the request whose body is still coming with a JSON error and close: its route, still reading the
        body, can send nothing more, and counts the request by what the scope says was sent."""
        cycle = self.cycle
        cycle.scope[CUT_BY_SERVER] = (status, message, kind)
        body = json.dumps(error_body(status, message, kind)[1]).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        if not self.transport.is_closing():
            self.transport.write(head.encode() + body)
        self._close(self, reason)


def guarded_protocol(
    header_timeout: float,
    body_timeout: float,
    max_connections: int,
    api_key: str | None,
    closed_by_server: Callable[[str], None],
) -> type[GuardedH11]:
    """The protocol class for one server's limits, its key and its counter of the connections it closed."""
    return type(
        "GuardedH11",
        (GuardedH11,),
        {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "max_connections": max_connections,
            "api_key": api_key,
            "closed_by_server": staticmethod(closed_by_server),
        },
    )
