"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, or in the shape of the dialect a path
belongs to (each endpoint declares its own: serve/endpoints.py), each counted in /metrics."""

from __future__ import annotations

from collections.abc import Callable

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


# An error as a dialect answers it: (status, JSON body).
Shape = Callable[[ApiError], tuple[int, dict]]


def openai_shape(error: ApiError) -> tuple[int, dict]:
    return error.status, {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}


class ErrorResponses:
    """Builds error responses, in the shape of the request's path (`shapes`; OpenAI's for any other), and counts
    them by code (or type) in `embedding_errors_total`."""

    def __init__(self, total: Counter, shapes: dict[str, Shape] | None = None):
        self.total, self.shapes = total, shapes or {}

    def __call__(self, error: ApiError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
        self.total.labels(type=error.code or error.type).inc()
        status, body = self.shape_for(path)(error)
        return JSONResponse(body, status_code=status, headers=headers)

    def shape_for(self, path: str) -> Shape:
        return self.shapes.get(path, openai_shape)


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


def not_json(content_type: str | None) -> str | None:
    """The Content-Type a request sent where it is not JSON (FastAPI parses a body without one as JSON)."""
    media = (content_type or "").split(";")[0].strip().lower()
    return None if not media or media == "application/json" or media.endswith("+json") else media


def add_error_handlers(app: FastAPI, fail: ErrorResponses) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            return fail(ApiError(400, "The request body is not valid JSON.", code="invalid_json"), path=path)
        if (sent := not_json(request.headers.get("content-type"))) is not None:
            # FastAPI reads such a body as bytes and reports only the fields it then lacks (curl -d sends forms)
            message = f"The request body must be JSON: send the header Content-Type: application/json (not {sent})."
            return fail(ApiError(400, message, code="invalid_content_type"), path=path)
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return fail(ApiError(400, f"Invalid request: {details}"), path=path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own: an unknown path (404), a method the path does not take (405, with Allow); FastAPI's
        400 for a body json.loads fails on with more than a JSON syntax error."""
        if (reason := unparsable_body(exc.__cause__)) is not None:
            return fail(ApiError(400, reason, code="invalid_body"), path=request.url.path)
        what = {404: "Invalid URL", 405: "Method not allowed"}.get(exc.status_code, exc.detail)
        error = ApiError(exc.status_code, f"{what} ({request.method} {request.url.path}).", code=None)
        return fail(error, headers=exc.headers, path=request.url.path)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return fail(exc, path=request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return fail(server_error(exc), path=request.url.path)
