"""What a refused caller is told, wherever the refusal is made (a route, the guard, or the connection itself when
no route can answer any more): one JSON error body, and the API key check that decides most refusals."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any


def error_body(status: int, message: str, kind: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def authorized(header: str | None, keys: str) -> bool:
    return key_tenant(header, keys) is not None


def key_tenant(header: str | None, keys: str) -> str | None:
    """The tenant that `Authorization: Bearer KEY` names: a digest of the key, one of `keys` (comma-separated, as
    llama-server's --api-key), each compared in constant time; None where none matches."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    matched = None
    for key in filter(None, (part.strip() for part in keys.split(","))):
        if hmac.compare_digest(given.strip().encode(), key.encode()):
            matched = key
    return None if matched is None else hashlib.sha256(matched.encode()).hexdigest()[:16]
