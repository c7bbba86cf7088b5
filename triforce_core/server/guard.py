"""What keeps web pages and DNS rebinding away from a local server: a browser may send a "simple"
cross-origin POST (text/plain, a form) without asking, and a page on a rebound name reaches
127.0.0.1 with its own Host header. So bodies are accepted only as application/json (a type a
browser must ask before sending cross-origin, which CORS then refuses unless --allow-origin says
so), and a server bound to a loopback address answers only loopback Host names (plus
--allow-host ones)."""
from __future__ import annotations

import ipaddress
import json

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from triforce.server.protocol import ApiError

BODY_BYTES = 64 << 20  # a request body is read whole: refuse a larger one
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(bind_address: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names a server bound to `bind_address` answers; None: any (a network bind, where
    --api-key is the guard)."""
    try:
        loopback = ipaddress.ip_address(bind_address.strip("[]")).is_loopback
    except ValueError:
        loopback = bind_address == "localhost"
    return LOOPBACK_NAMES | {h.lower() for h in extra} if loopback else None


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    if header.startswith("["):
        return header[1:header.find("]")].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


class HostGuard:
    """ASGI middleware: a request whose Host is not among `hosts` gets a 400 in OpenAI's shape."""

    def __init__(self, app, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            name = host_name(Headers(scope=scope).get("host", ""))
            if name not in self.hosts:
                error = ApiError(400, f"Host '{name}' is not served here: this server listens on a loopback "
                                      f"address (start it with --allow-host {name or 'NAME'} to answer that name)")
                await JSONResponse(error.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_json_type(headers) -> None:
    """Refuse a body that is not declared application/json (what a browser sends unasked)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"send the body as Content-Type: application/json (got {kind or 'none'})")


def network_warning(bind_address: str, api_key: str | None) -> str | None:
    """The line to print when a server anyone on the network may reach has no key."""
    if api_key is not None or allowed_hosts(bind_address) is not None:
        return None
    return (f"triforce serve: warning: listening on {bind_address} without --api-key: anyone who can reach "
            f"this port can run the model (set --api-key or $TRIFORCE_API_KEY)")


async def read_json_body(request):
    """The body as JSON, or an ApiError decided before any work: too large, cut off by the client,
    not JSON, nested past Python's recursion limit, or holding a lone surrogate escape
    ("\\ud800"), which is no text any tokenizer takes."""
    check_json_type(request.headers)
    size = 0
    chunks = []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {BODY_BYTES >> 20} MiB")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer; no traceback in the log
        raise ApiError(400, "the client disconnected while sending the body") from None
    try:
        body = json.loads(b"".join(chunks))
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be encoded
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a lone surrogate escape (e.g. \\ud800), which is not text") from None
    return body
