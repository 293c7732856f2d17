"""Which `Host` and `Origin` a request may carry.

Without a Host check, a web page on any domain can make a browser talk to a server on
127.0.0.1 by pointing its own name there (DNS rebinding); without an Origin check, any page
the user opens can post to the server or open its WebSocket. So the `Host` header's name must
be a trusted one, and a request that carries an `Origin` (browsers send it on cross-site
requests, WebSocket handshakes and POSTs) must come from the server's own origin or an allowed
one. Clients other than browsers send no Origin and are not affected.
"""

from __future__ import annotations

from urllib.parse import urlsplit

ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def host_name(host_header: str) -> str:
    """The name in a `Host` header (`name`, `name:port`, `[v6]:port`), lowercase."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_is_trusted(host_header: str | None, trusted: tuple[str, ...]) -> bool:
    """True when the `Host` header names a trusted host (its port is not checked)."""
    if ANY in trusted:
        return True
    return host_header is not None and host_name(host_header) in trusted


def origin_is_allowed(
    origin: str | None, host_header: str | None, allowed: tuple[str, ...]
) -> bool:
    """True without an `Origin`, for the server's own origin, or for an allowed one."""
    if origin is None or ANY in allowed:
        return True
    normalized = origin.strip().lower().rstrip("/")
    if normalized in allowed:
        return True
    return host_header is not None and _same_origin(normalized, host_header)


def _same_origin(origin: str, host_header: str) -> bool:
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
        host_port = urlsplit(f"//{host_header.strip().lower()}").port
    except ValueError:  # a port out of range, a broken IPv6 literal
        return False
    default = _DEFAULT_PORTS.get(parts.scheme)
    if default is None or parts.hostname is None:
        return False  # "null" (a sandboxed page, a file), or not a web origin
    same_port = (origin_port or default) == (host_port or default)
    return parts.hostname == host_name(host_header) and same_port
