"""What every request meets before its API's handler: the Host check of a local bind and the
access log (`Front`, ASGI middleware), the API key (Authorization: Bearer KEY, or Anthropic's
x-api-key), Anthropic's anthropic-version header, and the body read within its size limit."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time

from starlette.requests import Request as HttpRequest

from edgekv.serve.api import Api, ApiError

log = logging.getLogger("edgekv.serve")

LOCAL_NAMES = {"127.0.0.1", "localhost", "[::1]"}  # what a Host header may name for such a bind (any port)
VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")  # anthropic-version: a dated version such as 2023-06-01


def tenant_of(key: str) -> str:
    """A stable, non-secret name for an API key: the batcher keeps each tenant's prefixes apart."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def caller(request: HttpRequest, keys: list[tuple[bytes, str]]) -> str:
    """The caller's tenant; 401 unless it sent one of the keys (each compared in constant time),
    as Authorization: Bearer KEY or as x-api-key: KEY (Anthropic's clients)."""
    if not keys:
        return ""
    auth = request.headers.get("authorization", "").encode("latin-1")
    xkey = request.headers.get("x-api-key", "").encode("latin-1")
    found = [t for k, t in keys if hmac.compare_digest(auth, b"Bearer " + k) or hmac.compare_digest(xkey, k)]
    if not found:
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                       kind="authentication_error", code="invalid_api_key")
    return found[0]


def check_version(request: HttpRequest, api: Api) -> None:
    """Anthropic's clients send anthropic-version (any dated version is served the same); a
    client without it (curl) is served too."""
    v = request.headers.get("anthropic-version")
    if api is Api.MESSAGES and v is not None and not VERSION.fullmatch(v.strip()):
        raise ApiError(400, f"anthropic-version must be a dated version such as 2023-06-01 (got {v[:40]!r})")


async def read_body(request: HttpRequest, max_body_bytes: int) -> bytes:
    """The raw body of a JSON POST, at most max_body_bytes (by Content-Length, then counted as it
    arrives, for chunked bodies and lying lengths)."""
    ctype = request.headers.get("content-type", "")
    media, *params = [p.strip().lower() for p in ctype.split(";")]
    charset = next((p[8:].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if media != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"the body must be sent as Content-Type: application/json (got {ctype[:80]!r})",
                       code="unsupported_media_type")
    too_big = ApiError(413, f"the request body is larger than {max_body_bytes} bytes (the server's --max-body)",
                       code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body_bytes:
        raise too_big
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_big
        parts.append(chunk)
    return b"".join(parts)


def api_of_path(path: str) -> Api:
    """The API a path belongs to (the shape of a 404's or 405's error)."""
    return Api.MESSAGES if path.startswith("/v1/messages") else Api.CHAT


def host_of(headers: list) -> str | None:
    """The host name a request's Host header names, without its port (None: no Host header)."""
    raw = next((v for k, v in headers if k == b"host"), None)
    if raw is None:
        return None
    host = raw.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host


class Front:
    """ASGI middleware in front of every route: the Host check of a local bind (a web page that
    points a name it controls at 127.0.0.1 sends that name), and one access-log line per request."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [None]

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            host = host_of(scope["headers"])
            if self.server.check_host and host is not None and host not in LOCAL_NAMES:
                await ApiError(421, f"this server listens on a local address and answers only requests for "
                                    f"{sorted(LOCAL_NAMES)}, not {host[:100]!r}", code="host_not_allowed"
                               ).response(api_of_path(scope["path"]))(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            p, c = scope.get("state", {}).get("usage", ("-", "-"))
            cut = " cut" if scope.get("state", {}).get("cut") else ""  # ended by the drain (serve/drain.py)
            log.info("%s %s %s prompt=%s completion=%s %.3fs", scope["method"], scope["path"][:200],
                     f"{status[0] or '-'}{cut}", p, c, time.perf_counter() - t0)
