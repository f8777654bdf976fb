"""Errors a client may see: an HTTP status and a message safe to show (no paths, addresses or traces)."""

from __future__ import annotations

from services.frontend.protocol import ErrorBody, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        error = ErrorBody(message=self.message, type=_TYPES.get(self.status, "server_error"),
                          param=self.param, code=self.status)
        return ErrorResponse(error=error).model_dump()
