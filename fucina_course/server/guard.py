"""Who may call the server: browsers' origins, Host names, the API key, the body's
size.  Checked by `Guard`, a pure ASGI middleware, before any route runs.

Browsers: a web page may send requests to a local server (a form, or `fetch` with
`Content-Type: text/plain`, needs no preflight), and DNS rebinding can make an
attacker's name point at 127.0.0.1.  So `Guard` refuses (403) a request whose
`Origin` is not the server's own or one given with `--cors-origins` (those get
CORS headers and preflight answers), and, on a loopback address, a `Host` that is
not a loopback name or one given with `--allow-hosts` (as Ollama does).  Clients
that send no Origin (curl, the `openai` client) are not affected.

Pure ASGI rather than starlette's BaseHTTPMiddleware, which wraps streaming
responses and gets in the way of noticing a disconnect (stream.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from ..errors import FucinaError
from .schema import ApiError

PREFLIGHT_MAX_AGE = 600      # seconds a browser may cache a preflight's answer


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Access:
    """Which browser origins may call the server, and which Host names it answers.

    Origins: a request that carries an `Origin` header (a browser, on behalf of a
    page) is refused unless the origin is the server's own (http://127.0.0.1:PORT,
    http://localhost:PORT, http://[::1]:PORT, http://HOST:PORT) or one of
    `cors_origins` ("*": any); those allowed get CORS headers.  Without this, any
    page the user visits may POST to the local server: a `text/plain` body is a
    "simple" request, sent without a preflight, and the server would parse it.

    Hosts (DNS rebinding: an attacker's name that resolves to 127.0.0.1 makes the
    page same-origin with the server): on a loopback address, the `Host` header
    must be a loopback name or address (localhost, *.localhost, 127.x.x.x, [::1];
    any port) or one of `allow_hosts` ("*": any).  On another address (the user
    exposed the port on purpose) Host is checked only if `allow_hosts` is given,
    and then the bound address and the loopback names are allowed too.  Ollama
    keeps the same two rules (OLLAMA_ORIGINS, and its Host check on loopback)."""

    def __init__(self, host: str, port: int, cors_origins=(), allow_hosts=()):
        origins = [normalize_origin(o) for o in cors_origins]
        self.any_origin = "*" in origins
        named = f"[{host}]" if ":" in host else host
        own = {f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]",
                                              named.lower())}
        if port == 80:       # a browser leaves the default port out of an Origin
            own |= {o[:-3] for o in own}
        self.origins = frozenset(own | {o for o in origins if o != "*"})
        hosts = [_host_name(h) for h in allow_hosts if h.strip()]   # a port: dropped
        self.any_host = "*" in hosts
        self.hosts = frozenset(hosts) | {host.lower()}
        self.check_host = not self.any_host and (is_loopback(host) or bool(hosts))

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.lower().rstrip("/") in self.origins

    def host_allowed(self, value: str | None) -> bool:
        if not self.check_host or value is None:   # HTTP/1.0 may send no Host
            return True
        name = _host_name(value)
        return _loopback_name(name) or name in self.hosts


def normalize_origin(value: str) -> str:
    """An origin as a browser sends it: scheme://host[:port], lower case, no path
    (a trailing slash is dropped); "*" and "null" stay as they are."""
    o = value.strip().lower().rstrip("/")
    if o in ("*", "null"):
        return o
    scheme, sep, rest = o.partition("://")
    if not sep or not scheme.isalpha() or not rest or "/" in rest or "@" in rest:
        raise FucinaError(f"--cors-origins: {value!r} is not an origin "
                          "(scheme://host[:port], e.g. http://localhost:3000, or *)")
    return o


def _host_name(value: str) -> str:
    """A Host header -> the name or address in it, lower case, port dropped."""
    v = value.strip().lower()
    if v.startswith("["):                        # [::1]:8080
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":")[0]
    return v.rstrip(".")


def _loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """Pure ASGI middleware, before any route runs: the Host and Origin rules
    (`Access`; preflights answered here), the API key (every route but /health),
    and the body size limit by Content-Length (a chunked body is also counted as
    it is read: `App._body`)."""

    def __init__(self, app, api_key: str | None, max_body: int, access: Access):
        self.app, self.max_body, self.access = app, max_body, access
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host")
        if not self.access.host_allowed(None if host is None
                                        else host.decode("latin-1")):
            return await _send(send, ApiError(
                403, f"Host {host.decode('latin-1')[:100]!r} refused: this server "
                "answers to loopback names only (start it with --allow-hosts NAME "
                "to add one)", code="host_not_allowed"))
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if not self.access.origin_allowed(text):
                return await _send(send, ApiError(
                    403, f"cross-origin request from {text[:100]!r} refused: start the "
                    "server with --cors-origins ORIGIN to allow a web page to call it",
                    code="origin_not_allowed"))
            cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
            if (scope.get("method") == "OPTIONS"
                    and b"access-control-request-method" in headers):
                return await _preflight(send, cors, headers)
            send = _adding(send, cors + [(b"access-control-expose-headers",
                                          b"Retry-After")])
        if self.key is not None and scope.get("path") != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                return await _send(send, ApiError(
                    401, "Incorrect or missing API key: send 'Authorization: "
                    "Bearer <key>'", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                too_big = False
            if too_big:
                return await _send(send, ApiError(
                    413, f"the request body is over {self.max_body} bytes",
                    code="request_too_large"))
        await self.app(scope, receive, send)


async def _preflight(send, cors: list, headers: dict) -> None:
    """A CORS preflight from an allowed origin: 204, the methods, and the request
    headers the page asked for (Authorization and Content-Type always), so that
    clients sending their own headers (the JavaScript `openai` client's
    x-stainless-*) work; the origin was chosen by the user, so it is trusted."""
    asked = headers.get(b"access-control-request-headers", b"").decode("latin-1")
    names = {"Authorization", "Content-Type"}
    names |= {h.strip() for h in asked.split(",")
              if h.strip() and all(c.isalnum() or c in "-_" for c in h.strip())}
    out = cors[:1] + [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", ", ".join(sorted(names)).encode()),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE).encode()),
        (b"vary", b"Origin, Access-Control-Request-Method, "
                  b"Access-Control-Request-Headers"),
        (b"content-length", b"0")]
    if headers.get(b"access-control-request-private-network") == b"true":
        out.append((b"access-control-allow-private-network", b"true"))  # Chrome PNA
    await send({"type": "http.response.start", "status": 204, "headers": out})
    await send({"type": "http.response.body", "body": b""})


def _adding(send, extra: list):
    """`send`, with `extra` headers added to the response's start."""
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers", [])) + extra}
        await send(message)
    return wrapped


async def _send(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status,
                "headers": headers})
    await send({"type": "http.response.body", "body": body})

