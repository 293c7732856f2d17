"""Fetching a chat request's `http(s)://` media, without letting a URL reach what it should not.

A URL's host must be in `allowed_hosts`: `host` allows the scheme's default port only,
`host:port` that port. Its name is resolved here and every address it resolves to is checked:
loopback, link-local and private (any non-global) addresses are refused unless an entry names
that very address, so an allowed name cannot be pointed at the server's own network. The
request then goes to the checked address (the name stays in `Host` and TLS), so a second
lookup cannot send it elsewhere. No redirects, a size cap, a total time limit; the body is
asked for uncompressed, and a compressed one is inflated a bounded piece at a time, so a small
reply cannot balloon in memory before the size cap sees it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import httpx

from stillcut.service.config import ServerConfig
from stillcut.service.errors import bad_request
from stillcut.service.media import MediaKind, check_content_type, too_large

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_PORTS = {"http": 80, "https": 443}
INFLATE_CHUNK_BYTES = 64 * 1024  # the most one step of inflating may produce
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str  # lowercase; an IPv6 literal without brackets
    port: int
    path: str  # with the query


async def fetch_media(
    url: str, kind: MediaKind, where: str, config: ServerConfig, client: httpx.AsyncClient
) -> bytes:
    """The bytes behind an `http(s)://` media URL; `APIError` (400/413/415) otherwise."""
    target = _target(url, where)
    if not _listed(target.host, target.port, target.scheme, config.allowed_hosts):
        raise bad_request(
            f"{where}: host {target.host!r} port {target.port} is not in the server's "
            "allowed hosts",
            "url_not_allowed",
        )
    try:
        async with asyncio.timeout(config.fetch_timeout_s):
            address = await _checked_address(target, where, config.allowed_hosts)
            return await _download(target, address, kind, where, config, client)
    except TimeoutError:
        raise bad_request(
            f"{where}: fetching it took longer than {config.fetch_timeout_s:g} s",
            "media_fetch_failed",
        ) from None
    except httpx.HTTPError as error:
        raise bad_request(
            f"{where}: fetching it failed ({_failure(error)})", "media_fetch_failed"
        ) from None


def _failure(error: httpx.HTTPError) -> str:
    """What went wrong, in words: the library's text names its own source files."""
    if isinstance(error.__context__, ssl.SSLError) or "SSL" in str(error):
        return "the TLS handshake failed"
    if isinstance(error, httpx.TimeoutException):
        return "it timed out"
    if isinstance(error, httpx.ConnectError):
        return "could not connect"
    if isinstance(error, httpx.RemoteProtocolError):
        return "the reply broke the HTTP protocol"
    return "the connection broke"


def _target(url: str, where: str) -> _Target:
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError as error:  # "Port out of range", "Invalid IPv6 URL"
        raise bad_request(f"{where} is not a valid URL ({error})", "invalid_url") from None
    if not parts.hostname:
        raise bad_request(f"{where} names no host", "invalid_url")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    scheme = parts.scheme.lower()
    return _Target(scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme], path)


def _listed(host: str, port: int, scheme: str, entries: tuple[str, ...]) -> bool:
    """True when an `allowed_hosts` entry names `host` at `port` (no port: the default one)."""
    for entry in entries:
        try:
            parts = urlsplit(f"//{entry}")
            entry_port = parts.port or DEFAULT_PORTS[scheme]
        except ValueError:
            continue
        if parts.hostname == host and entry_port == port:
            return True
    return False


async def _checked_address(target: _Target, where: str, entries: tuple[str, ...]) -> IPAddress:
    """The address to connect to: every address the host resolves to must be global, or
    listed in `allowed_hosts` by address."""
    addresses = await _resolve(target.host, target.port, where)
    for address in addresses:
        is_global = address.is_global and not address.is_multicast
        if not is_global and not _listed(str(address), target.port, target.scheme, entries):
            raise bad_request(
                f"{where}: host {target.host!r} resolves to {address}, a loopback, link-local "
                "or private address; list that address in the allowed hosts to fetch from it",
                "url_not_allowed",
            )
    return addresses[0]


async def _resolve(host: str, port: int, where: str) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass  # a name
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise bad_request(
            f"{where}: host {host!r} could not be resolved ({error.strerror or error})",
            "media_fetch_failed",
        ) from None
    # sockaddr[0] may carry an IPv6 zone ("fe80::1%eth0"); the address is what is checked
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


async def _download(
    target: _Target,
    address: IPAddress,
    kind: MediaKind,
    where: str,
    config: ServerConfig,
    client: httpx.AsyncClient,
) -> bytes:
    literal = f"[{address}]" if address.version == 6 else str(address)
    default_port = target.port == DEFAULT_PORTS[target.scheme]
    host_header = target.host if default_port else f"{target.host}:{target.port}"
    if ":" in target.host:  # an IPv6 literal host
        host_header = f"[{target.host}]" + ("" if default_port else f":{target.port}")
    url = f"{target.scheme}://{literal}:{target.port}{target.path}"
    headers = {"Host": host_header, "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    request = client.build_request("GET", url, headers=headers, extensions=extensions)
    response = await client.send(request, stream=True, follow_redirects=False)
    try:
        if response.status_code != 200:
            raise bad_request(
                f"{where}: fetching it returned HTTP {response.status_code}", "media_fetch_failed"
            )
        check_content_type(response.headers.get("content-type"), kind, where)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        return await _read_limited(response.aiter_raw(), encoding, where, config.max_upload_bytes)
    finally:
        await response.aclose()


async def _read_limited(
    raw_chunks: AsyncIterator[bytes], encoding: str, where: str, limit: int
) -> bytes:
    if encoding not in ("identity", *_WBITS):
        raise bad_request(
            f"{where}: the reply is {encoding!r}-encoded; allowed: identity, gzip, deflate",
            "media_fetch_failed",
        )
    inflater = zlib.decompressobj(_WBITS[encoding]) if encoding in _WBITS else None
    chunks, num_bytes = [], 0

    def keep(piece: bytes) -> None:
        nonlocal num_bytes
        num_bytes += len(piece)
        if num_bytes > limit:
            raise too_large(f"{where}'s content", limit)
        chunks.append(piece)

    async for raw in raw_chunks:
        for piece in (raw,) if inflater is None else _inflate(inflater, raw, where):
            keep(piece)
    if inflater is not None:
        keep(inflater.flush())
    return b"".join(chunks)


def _inflate(inflater, data: bytes, where: str) -> Iterator[bytes]:
    """Inflate `data` at most `INFLATE_CHUNK_BYTES` at a time."""
    try:
        while data:
            yield inflater.decompress(data, INFLATE_CHUNK_BYTES)
            data = inflater.unconsumed_tail
    except zlib.error as error:
        raise bad_request(
            f"{where}: its compressed reply is corrupt ({error})", "media_fetch_failed"
        ) from None
