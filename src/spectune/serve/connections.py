"""The server's connections: no peer that is idle, trickles its headers or its body, or never authenticates can
hold a place a caller needs.

uvicorn counts every open connection against `limit_concurrency` and answers 503 in plain text past it, so 64 sockets
that send nothing lock every caller out, /health included. spectune turns that limit off (the app bounds the requests
in progress itself) and bounds the connections here instead:

- a request's headers must arrive within `header_timeout` of its start, the first on a connection and every later one
  on a kept-alive connection (a slowloris trickling bytes resets uvicorn's keep-alive timer, not this one);
- its body within `body_timeout` of its headers: past it the connection closes and the request counts as 408;
- an answer sent before its request's body was all read (401, 413) closes the connection at once;
- past `max_connections`, a new connection closes the oldest one that holds no request in progress (idle, awaiting
  headers, or trickling a body), so hostile connections make room for a caller instead of shutting it out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

BODY_TIMED_OUT = "spectune.body_timed_out"  # the scope key that tells the app a body was cut for its slowness


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the limits above (a subclass per server sets the class attributes)."""

    header_timeout = 10.0
    body_timeout = 10.0
    max_connections = 1024
    closed_by_server: Callable[[str], None] = staticmethod(lambda reason: None)  # counts each close by reason
    arrivals = itertools.count()  # the order connections came in (the oldest makes room first)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.opened = next(self.arrivals)
        self.body_deadline: Any = None
        self.timed_body: Any = None  # the request cycle whose body is being timed
        self._await_headers()
        self._make_room()

    def holds_no_request(self) -> bool:
        """Idle, awaiting headers, or still receiving a body: what a new connection may push out."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def _make_room(self) -> None:
        if len(self.connections) <= self.max_connections:
            return
        others = [c for c in self.connections if c is not self and c.holds_no_request()]
        if others:
            self._close(min(others, key=lambda c: c.opened), "evicted")
        else:  # every other connection carries a request in progress: this one waits for none of them
            self._close(self, "full")

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
        if cycle is self.cycle and cycle.more_body and not cycle.response_complete:
            cycle.scope[BODY_TIMED_OUT] = True
            self._close(self, "body_timeout")


def guarded_protocol(
    header_timeout: float, body_timeout: float, max_connections: int, closed_by_server: Callable[[str], None]
) -> type[GuardedH11]:
    """The protocol class for one server's limits and its counter of the connections it closed."""
    return type(
        "GuardedH11",
        (GuardedH11,),
        {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "max_connections": max_connections,
            "closed_by_server": staticmethod(closed_by_server),
        },
    )
