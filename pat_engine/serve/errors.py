"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pat_engine.errors import validation_message
from pat_engine.serve.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "APIError"), param=self.param,
                         code=self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The in-band form used once a stream has started (HTTP status already 200)."""
        return f"data: {json.dumps(self.body())}\n\n"


def validation_error(exc: ValidationError) -> APIError:
    """One 400 naming every offending field, e.g. ``max_tokens: Input should be greater than or equal to 1``."""
    params = [".".join(str(p) for p in err.get("loc", ())) for err in exc.errors()]
    message = validation_message(exc, unknown="unknown or unsupported field '{loc}'")
    return APIError(400, message or "invalid request", param=params[0] if len(params) == 1 else None)
