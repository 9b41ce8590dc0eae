"""A refused request as OpenAI answers one: `RequestError` (a 4xx, or a 429 or 503 when the server
cannot take it now) and its error body ``{"error": {"message", "type", "param", "code"}}``; and
`refusal`, the `RequestError` of a request body that the request models (`serve.protocol`) did
not validate."""
from __future__ import annotations

from typing import Dict, Optional

from pydantic import ValidationError


class RequestError(ValueError):
    """A request the server refuses: `status` (4xx; 500 or 503 for one that failed or was cut),
    OpenAI's error `type` and `code`, the `param` (the field at fault, dotted for a nested one:
    ``stream_options.include_usage``), and the response's `headers` (a 429's ``Retry-After``)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code, self.headers = status, param, type, code, headers

    def body(self) -> dict:
        """OpenAI's error body of this error (`error_body`)."""
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def refusal(error: ValidationError) -> RequestError:
    """The `RequestError` a request answers for `error`, pydantic's errors of a request model.

    The first error is the one answered (the fields are declared in the order they are checked, so
    it is the first field at fault): the `RequestError` a validator raised, as it was raised (its
    message names the field and says what to send instead); a required field that is missing
    (``messages``) is "<field> is required"; any other error of pydantic's own (none is expected:
    the validators check every type) is its message, prefixed with the field."""
    first = error.errors()[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, RequestError):
        return raised
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "missing":
        return RequestError(f"{param} is required", param)
    message = str(raised) if isinstance(raised, ValueError) else first["msg"]
    return RequestError(f"{param}: {message}" if param else message, param)
