"""Errors a client may see: an HTTP status and a message safe to show (no paths, addresses or traces),
as an OpenAI error body."""

from __future__ import annotations

from services.frontend.protocol import ErrorBody, ErrorResponse
from shared.errors import ServiceError

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(ServiceError):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param

    def body(self) -> dict:
        error = ErrorBody(message=self.message, type=_TYPES.get(self.status, "server_error"),
                          param=self.param, code=self.status)
        return ErrorResponse(error=error).model_dump()
