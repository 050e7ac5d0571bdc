"""`--api-key`: a pure ASGI middleware requiring `Authorization: Bearer KEY` on every route but
the open ones (it wraps nothing else, so streaming and disconnect detection are untouched)."""

from __future__ import annotations

import hmac

from pagedserve.entrypoints.openai.errors import APIError


class APIKeyMiddleware:
    """401 in OpenAI's error shape unless the bearer token equals one of the keys (vLLM's
    `--api-key K1 K2 ...`; constant time)."""

    def __init__(self, app, api_key: str | list[str], open_paths: frozenset[str]) -> None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(keys):
            raise ValueError("api_key must not be empty")
        self.app = app
        self._keys = [k.encode() for k in keys]
        self.open_paths = open_paths

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        # NOTE: compare_digest runs in time independent of where the tokens differ; every key
        # is compared, even after a match or when the scheme is wrong.
        same = [hmac.compare_digest(token.strip(), key) for key in self._keys]
        return any(same) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        # NOTE: the open paths are matched without --root-path (uvicorn puts it in front of
        # every path); OPTIONS (CORS preflights) needs no key, as in vLLM.
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or route_path(scope) in self.open_paths):
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        if self.authorized(header):
            await self.app(scope, receive, send)
            return
        error = APIError("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def route_path(scope) -> str:
    """The request's path without the `root_path` prefix (as the router matches it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path
