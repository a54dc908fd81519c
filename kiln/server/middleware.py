"""The server's two middlewares, plain ASGI: Starlette's BaseHTTPMiddleware hands the endpoint
a wrapped receive channel on which a client's disconnect never arrives, so a non-streaming
request went on generating for a client that had gone.

- RequestGuard: the API key on /v1 (health, metrics and the docs stay open), and the body-size
  limit, checked before anything is read.
- ResponseCounter: every response counted by route, method and status, the server's own
  refusals and errors included."""

from __future__ import annotations

import secrets

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.errors import error_response


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope):
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        guarded = self.api_key and scope["path"].startswith("/v1")
        if guarded and not _same(headers.get("authorization", ""), f"Bearer {self.api_key}"):
            return error_response(
                401,
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                "AuthenticationError",
                headers={"WWW-Authenticate": "Bearer"},
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(
                413,
                f"the request body is {length} bytes; the limit is {self.max_body_bytes}",
                "BadRequestError",
            )
        return None


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


class ResponseCounter:
    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # an exception before any response is the 500 the outermost handler sends
            code = str(status[0] or 500)
            self.counter.labels(route_of(scope), scope["method"], code).inc()


def route_of(scope: Scope) -> str:
    """The route's path template; one label for every path no route matches, so that a scan of
    random URLs cannot grow the metric without bound."""
    route = scope.get("route")
    return getattr(route, "path", None) or "(unmatched)"
