"""Errors as clients see them: OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from hybridkv.server.protocol import ErrorInfo, ErrorResponse

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                413: "RequestTooLargeError",
                422: "UnprocessableEntityError", 499: "ClientDisconnectedError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
_FIELD_PREFIX = re.compile(r"^(\w+)(?::| must| requires| is )")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def bad_request(cls, error: Exception) -> APIError:
        message = str(error)
        match = _FIELD_PREFIX.match(message)
        return cls(400, message, match.group(1) if match else None)


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error body for ``status`` (also sent as the last event of a stream that fails)."""
    error_type = _ERROR_TYPES.get(status, "APIError")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)
