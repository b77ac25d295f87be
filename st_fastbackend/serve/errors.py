"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, each counted in /metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code


def server_error(error: BaseException) -> ApiError:
    """Our own failure on one request: 500, naming the exception (its traceback goes to the log)."""
    return ApiError(500, f"The server failed on this request ({type(error).__name__}).", type="server_error")


class ErrorResponses:
    """Builds error responses and counts them by code (or type) in `embedding_errors_total`."""

    def __init__(self, total: Counter):
        self.total = total

    def __call__(self, error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
        self.total.labels(type=error.code or error.type).inc()
        body = {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}
        return JSONResponse(body, status_code=error.status, headers=headers)


def unparsable_body(cause: BaseException | None) -> str | None:
    """What json.loads found wrong with a body where FastAPI only says "There was an error parsing the body"."""
    if isinstance(cause, UnicodeDecodeError):
        if cause.object[:2] == b"\x1f\x8b":
            return "The request body is gzip-compressed; send it uncompressed, as JSON in UTF-8."
        byte = cause.object[cause.start]
        return f"The request body is not valid UTF-8: byte 0x{byte:02x} at position {cause.start}."
    if isinstance(cause, RecursionError):
        return "The request body nests JSON arrays or objects deeper than the parser goes."
    return None


def add_error_handlers(app: FastAPI, fail: ErrorResponses) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            return fail(ApiError(400, "The request body is not valid JSON."))
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return fail(ApiError(400, f"Invalid request: {details}"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own: an unknown path (404), a method the path does not take (405, with Allow); FastAPI's
        400 for a body json.loads fails on with more than a JSON syntax error."""
        if (reason := unparsable_body(exc.__cause__)) is not None:
            return fail(ApiError(400, reason, code="invalid_body"))
        what = {404: "Invalid URL", 405: "Method not allowed"}.get(exc.status_code, exc.detail)
        error = ApiError(exc.status_code, f"{what} ({request.method} {request.url.path}).", code=None)
        return fail(error, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return fail(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return fail(server_error(exc))
