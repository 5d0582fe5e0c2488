"""What a refused caller is told, wherever the refusal is made (a route, the guard, or the connection itself when
no route can answer any more): one JSON error body, and the API key check that decides most refusals."""

from __future__ import annotations

import hmac
from typing import Any


def error_body(status: int, message: str, kind: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def authorized(header: str | None, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case, the key compared in constant time."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
