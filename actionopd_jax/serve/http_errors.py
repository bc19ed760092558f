"""Every error this server sends is OpenAI's error JSON: a route's failure (error_response)
and, through the app's middleware (json_http_errors), aiohttp's own 404/405 and anything a
route did not expect, which aiohttp would otherwise answer as plain text."""

from __future__ import annotations

import logging

from aiohttp import web

from actionopd_jax.serve.requests import RequestError, release_body_slot

log = logging.getLogger(__name__)


def error_response(err: Exception) -> web.Response:
    """A route's failure as an HTTP error: a RequestError with its own status, anything else
    (a backend bug) as a 500 with a message, never a dropped connection."""
    if not isinstance(err, RequestError):
        err = RequestError(500, f"backend error: {type(err).__name__}: {err}", "server_error")
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def json_http_errors(request: web.Request, handler):
    """aiohttp's own refusals (an unknown path: 404, a wrong method: 405) in OpenAI's error JSON,
    like every other error of this server, not as plain text (issue 34); so is anything a route
    did not expect (a JSON 500, where aiohttp would answer plain text: issue 46). A large-body
    slot the request still holds is given back here, however it ended."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status not in (404, 405):
            raise
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        message = (f"no route {request.method} {request.path}; this server answers POST /v1/chat/completions, "
                   "POST /v1/completions and GET /v1/models" if e.status == 404 else
                   f"{request.method} is not allowed on {request.path}" + (f" (allowed: {allowed})" if allowed else ""))
        code = "not_found" if e.status == 404 else "method_not_allowed"
        return web.json_response(RequestError(e.status, message, code=code).body(), status=e.status,
                                 headers={"Allow": allowed} if allowed else None)
    except Exception as e:  # noqa: BLE001 - a bug of ours, answered in JSON and logged with its traceback
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return error_response(e)
    finally:
        release_body_slot()
