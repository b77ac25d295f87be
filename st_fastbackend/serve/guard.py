"""What every request passes before the app sees it: the API key, then the body, read in full while its
bytes are counted. A plain ASGI wrapper: Starlette's @app.middleware("http") costs a noticeable share of
a small request."""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers

from st_fastbackend.serve.errors import ApiError, ErrorResponses


class Guard:
    """401 without the key (every path but `public_paths`); 415 for a compressed body (Content-Encoding); 413
    as soon as the body passes `max_body_bytes`, whether it comes with a Content-Length or chunked; 408 when
    the whole body has not arrived within `body_timeout` seconds, so a stalled client neither holds a
    connection nor keeps a SIGTERM from finishing. The app then reads the body from memory."""

    def __init__(
        self,
        app,
        *,
        fail: ErrorResponses,
        api_key: str | None,
        public_paths: set[str],
        max_body_bytes: int,
        body_timeout: float,
    ):
        self.app, self.fail, self.public_paths = app, fail, public_paths
        self.key = api_key.encode() if api_key is not None else None
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.key is not None and scope["path"] not in self.public_paths and not self._authorized(headers):
            error = ApiError(401, "Missing or wrong API key.", "authentication_error", "invalid_api_key")
            return await self.fail(error, path=scope["path"])(scope, receive, send)
        if headers.get("content-encoding", "identity").lower() != "identity":
            message = f"Content-Encoding {headers['content-encoding']!r} is not supported; send the body uncompressed."
            error = ApiError(415, message, code="unsupported_content_encoding")
            return await self.fail(error, path=scope["path"])(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(headers, receive), self.body_timeout)
        except ApiError as error:
            return await self.fail(error, path=scope["path"])(scope, receive, send)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            message = f"The request body did not arrive within {self.body_timeout:g} s."
            error = ApiError(408, message, code="body_timeout")
            return await self.fail(error, headers={"connection": "close"}, path=scope["path"])(scope, receive, send)
        if body is not None:  # None: the client left
            await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")  # the scheme is case-insensitive
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"Request body over {self.max_body_bytes} bytes.", code="body_too_large")

    async def _read_body(self, headers: Headers, receive) -> bytes | None:
        if int(headers.get("content-length", 0)) > self.max_body_bytes:  # the server's parser checked the digits
            raise self._too_large()
        chunks, size = [], 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body_bytes:
                    raise self._too_large()
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:  # a refused body's traceback (in a cycle with wait_for's task) would keep the chunks until gc
            chunks.clear()


def _replay(body: bytes, receive):
    """The body as one message, then the server's own events (http.disconnect when the client leaves)."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
