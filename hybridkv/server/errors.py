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


# OpenAI routes this server does not serve, by path prefix: a 404 that says so (rather than FastAPI's bare one)
_UNSERVED = {
    "/v1/embeddings": "embeddings", "/v1/images": "image generation", "/v1/audio": "audio",
    "/v1/moderations": "moderations", "/v1/files": "files", "/v1/fine_tuning": "fine-tuning",
    "/v1/batches": "the Batch API", "/v1/assistants": "the Assistants API", "/v1/threads": "the Assistants API",
    "/v1/vector_stores": "vector stores", "/v1/rerank": "reranking", "/v1/score": "scoring",
}


def unserved_route(path: str) -> str | None:
    """The 404 message for an OpenAI route hybridkv does not serve, or None for any other path::

        >>> unserved_route("/v1/embeddings").split(":")[0]
        'this server does not serve embeddings (/v1/embeddings)'
    """
    what = next((w for prefix, w in _UNSERVED.items() if path == prefix or path.startswith(prefix + "/")), None)
    if what is None:
        return None
    return (f"this server does not serve {what} ({path}): hybridkv serves text generation only "
            "(/v1/completions, /v1/chat/completions)")


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
