"""OpenAI API shapes: request schemas (pydantic v2), response and error builders.

Unknown request fields are accepted and ignored rather than rejected: OpenAI SDKs and tools send
fields we have no use for (`user`, `metadata`, `parallel_tool_calls`, `logit_bias: {}` ...) and a
server that rejected them would be unusable from those clients. What we *cannot* honour is rejected
explicitly (see `check_supported`) so a client never gets output that silently ignores what it
asked for: n > 1, logprobs, echo, best_of > 1, non-zero penalties, logit bias, suffix, tools.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error the client caused (4xx) or should hear about, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after      # seconds, sent as the Retry-After header (429, 503)

    @property
    def headers(self) -> dict | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------------
# Requests

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's, plus the top_k / min_tokens / ignore_eos extensions."""
    model_config = ConfigDict(extra="ignore")
    # Reserved for the router and workers of a deployment (docs/HANDOFF.md); needs the control token.
    kv_transfer_params: dict | None = None

    model: str | None = None
    temperature: float | None = Field(None, description="0 = greedy; default 1")
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension; 0 or -1 disables")
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    min_tokens: int | None = Field(0, description="extension: generate at least this many tokens")
    ignore_eos: bool | None = Field(False, description="extension: keep going past end-of-sequence")
    return_token_ids: bool | None = Field(False, description="vLLM's extension: the prompt's token ids and the "
                                                             "generated ones in the answer (server.TokenIds)")
    # Present only so a non-default value can be refused with a clear message (check_supported).
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        if self.n is not None and self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; this server returns one choice per request "
                           "(send several requests instead)", param="n")
        if self.best_of is not None and self.best_of > 1:
            raise APIError(400, "best_of > 1 is not supported", param="best_of")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; omit it or set it to 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported; omit it", param="logit_bias")
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported", param="tools")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(..., description="a string or a list of token ids (a batch of one is accepted too)")
    max_tokens: int | None = 16               # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        """Accept str | list[int] | [str] | [list[int]]; return str or list[int]."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]                           # a batch of one
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt is empty")
            return v
        if not isinstance(v, list):
            raise ValueError("prompt must be a string or a list of token ids")
        if not v:
            raise ValueError("prompt is empty")
        if all(isinstance(t, (str, list)) for t in v):
            raise ValueError(f"batched prompts (a list of {len(v)} prompts) are not supported; "
                             "send one request per prompt")
        if not all(type(t) is int for t in v):
            raise ValueError("prompt must be a string or a list of token ids (integers)")
        if min(v) < 0:
            raise ValueError(f"prompt token ids must be non-negative, got {min(v)}")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported; omit the field", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content parts of type '{part.type}' are not supported; "
                               "this server takes text only", param="messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None              # deprecated by OpenAI in favour of ...
    max_completion_tokens: int | None = None   # ... this; either works, this one wins
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise APIError(400, "logprobs are not supported; omit the field", param="logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# ---------------------------------------------------------------------------------------------------
# Responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage_: dict, timings: dict | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_, "timings": timings}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage_: dict, timings: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_, "timings": timings}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def http_error(method: str, path: str, status: int, detail) -> APIError:
    """Starlette's own errors (no route, wrong method) in OpenAI's shape, saying what would work."""
    message = detail if isinstance(detail, str) else "request failed"
    if status == 404:
        message = f"no route {method} {path}; see /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"
    elif status == 405:
        message = f"method {method} is not allowed on {path}"
    return APIError(status, message)
