"""OpenAI-shaped request and response bodies, validated at the edge (pydantic).

Requests accept the fields OpenAI clients send; the ones swarmnode cannot honour (n > 1, logprobs, tools...)
are refused with a 400 naming the parameter rather than silently ignored. Unknown extra fields are ignored,
as OpenAI's own server does for fields newer than the client. One field is swarmnode's own, sent with the
`openai` client's `extra_body`: `prompt_lookup` (speculative decoding's draft length, 0 to 64).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarmnode.errors import SwarmError


class APIError(SwarmError):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

    The body's `code` is OpenAI's code for the error when it has one (`model_not_found`, ...) and null
    otherwise, as OpenAI's server answers; `APIError.code` is `api_error` then.
    """

    code = "api_error"

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, code=code)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.openai_code = code
        self.headers = dict(headers or {})  # sent with the response (`Retry-After`, `WWW-Authenticate`)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.openai_code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens (chat)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # swarmnode's extension (OpenAI clients send it with `extra_body`): speculative decoding by prompt lookup,
    # drafting up to this many tokens a pass (0: off; None: the server's `--prompt-lookup`). Same greedy output.
    prompt_lookup: int | None = Field(default=None, ge=0, le=64, strict=True)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not isinstance(s, str) or not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        elif isinstance(value, str) and not value:
            return None
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        """Refuse, with the parameter named, what this server does not implement."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice (n=1)", param="n")
        limit = self.requested_max_tokens()
        if limit is not None and limit <= 0:
            raise APIError(400, f"max_tokens must be at least 1, got {limit}", param="max_tokens")
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported",
                           param="presence_penalty" if self.presence_penalty else "frequency_penalty")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
            raise ValueError("only one prompt per request is supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
