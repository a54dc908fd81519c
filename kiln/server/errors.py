"""Every error the server returns, in OpenAI's envelope: validation failures and bad requests
as 400, unknown models 404, overload 503 with Retry-After, crashes 500 without a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import InvalidRequestError
from kiln.server.async_engine import EngineOverloaded, EngineStopped
from kiln.server.protocol import error_body

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(
    status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {msg}", None
    return (f"{param}: {msg}" if param else msg), param


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), "BadRequestError", exc.param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(EngineOverloaded)
    async def on_overload(request: Request, exc: EngineOverloaded):
        return error_response(
            503,
            f"the server is overloaded: {exc}; retry later",
            "ServiceUnavailableError",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(EngineStopped)
    async def on_stopped(request: Request, exc: EngineStopped):
        headers = {"Retry-After": "5"}
        return error_response(503, str(exc), "ServiceUnavailableError", headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        # a 405 carries the route's methods in `Allow` (RFC 9110)
        return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "InternalServerError")
