"""API errors, each with its HTTP status and OpenAI error type."""

from __future__ import annotations


class ApiError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    status = 400


class AuthenticationFailed(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class InsufficientCredits(ApiError):
    status = 402
    type = "insufficient_quota"
    code = "insufficient_quota"


class ModelNotFound(ApiError):
    status = 404
    code = "model_not_found"


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int, headers: dict) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


class NoCapacity(ApiError):
    status = 503
    type = "service_unavailable"
    code = "no_capacity"


class JobFailed(ApiError):
    status = 500
    type = "server_error"
    code = "job_failed"
