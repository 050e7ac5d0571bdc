"""Errors in OpenAI's shape, and turning the engine's ValueErrors into 400s naming the parameter."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

# vLLM's error type names (its ErrorResponse: `create_error_response` in vLLM's serving code)
# by status; any other status gets its HTTP phrase ("Unauthorized", "Service Unavailable", ...),
# as vLLM's handler of HTTP exceptions (unknown routes: "Not Found") names them.
_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
}


class APIError(Exception):
    """An error answered with `{"error": {...}}` and the given status (and headers)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: int | str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.code = code if code is not None else status
        self.kind = kind  # the error's `type` (default: by status, see _TYPES)

    def body(self) -> ErrorResponse:
        return error_body(self.message, self.status, self.param, self.code, self.kind)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def error_body(message: str, status: int, param: str | None = None,
               code: int | str | None = None, kind: str | None = None) -> ErrorResponse:
    kind = kind or _TYPES.get(status) or status_phrase(status)
    return ErrorResponse(error=ErrorInfo(
        message=message, type=kind, param=param, code=status if code is None else code,
    ))


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


_LEADING_NAME = re.compile(r"^([a-z_]+)")


def bad_request(exc: ValueError, known: set[str], rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError raised by SamplingParams or the engine. Their messages start with
    the parameter's name ("temperature must be ...", "logprobs=30 is more than ..."); `known`
    are the request's field names, `rename` maps engine names to the request's."""
    message = str(exc)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match else None
    if param == "prompt_token_ids":
        param = "prompt"
    if rename and param in rename:
        param = rename[param]
    if param not in known:
        param = None
    return APIError(message, 400, param)
