"""`--max-request-bytes`: a pure ASGI middleware bounding request bodies (413 in OpenAI's error
shape), before any of the body is buffered by the app."""

from __future__ import annotations

from pagedserve.entrypoints.openai.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than the server's limit of {limit} bytes "
                    "(--max-request-bytes).", 413)


class RequestSizeLimitMiddleware:
    """413 when a body is declared (Content-Length) or turns out (chunked) larger than
    `max_bytes`. A declared size is refused before reading anything; a chunked body is counted
    as it arrives, and the app's `receive` raises the 413 `APIError` once past the limit (the
    app's error handler answers it)."""

    def __init__(self, app, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await APIError("Invalid Content-Length header", 400).response()(
                        scope, receive, send)
                    return
                if declared > self.max_bytes:
                    await _too_large(self.max_bytes).response()(scope, receive, send)
                    return
                break
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
