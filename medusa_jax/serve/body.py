"""A request's body: read up to the server's limit (413 past it), parsed as JSON, and its fields
the server does not know logged (ignored, as vLLM ignores them)."""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request

from medusa_jax.serve.errors import RequestError
from medusa_jax.serve.protocol import unknown_fields_note

#: Where the server's own warnings go (`medusa-serve` prints them beside uvicorn's log).
log = logging.getLogger("medusa_jax.serve")

#: The largest request body read by default (bytes): far above any prompt that fits a context (a
#: 32k-token prompt is ~150 KB of text), so only a runaway or hostile client reaches it (413).
MAX_REQUEST_BYTES = 16 * 1024 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes kept; a larger one is refused (RequestError, status
    413) once read through (its bytes past the limit are discarded, not kept, so that the client
    gets the 413 on a clean connection), or at once when it declares or sends more than twice the
    limit (the connection is then closed under it)."""
    too_large = f"the request body is larger than this server's limit of {limit} bytes; send a shorter prompt"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 2 * limit:
        raise RequestError(too_large, status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 2 * limit:
            break
    if size > limit:
        raise RequestError(too_large, status=413, code="request_too_large")
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """`raw` parsed as JSON; RequestError (400) for bytes that are not JSON (or nest too deeply)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply to parse") from None


def warn_unknown(body: Any, known: frozenset, endpoint: str) -> None:
    """Log a warning naming the fields of `body` not in `known` (ignored, as vLLM ignores them:
    `protocol.unknown_fields_note`)."""
    note = unknown_fields_note(body, known, endpoint)
    if note:
        log.warning(note)
