"""HTTP-edge schemas: OpenAI-compatible requests, responses, stream chunks and errors.

These are separate from the bus messages (``nightjar.kernel.messages``): they are mutable, may hold
lists and dicts, and are only decoded/encoded at the HTTP edge. Requests forbid unknown fields; the
common OpenAI fields that Nightjar does not implement are declared so they can be validated (a
non-default value is a 400 "not supported", never silently ignored).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

# ---- errors --------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorDetail


class ApiError(Exception):
    """An OpenAI-shaped HTTP error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers or {}

    @property
    def body(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))


def unsupported(param: str, message: str | None = None) -> ApiError:
    return ApiError(message or f"{param} is not supported", 400, param=param, code="unsupported_parameter")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_error(e: msgspec.MsgspecError) -> ApiError:
    """A msgspec decode/validation error as a 400, with ``param`` set from the error's JSON path."""
    text = str(e)
    if isinstance(e, msgspec.ValidationError):
        m = _AT.search(text)
        param = m.group(1) if m and m.group(1) else None
        unknown = re.match(r"Object contains unknown field `([^`]*)`", text)
        if unknown:
            field = unknown.group(1)
            param = f"{param}.{field}" if param else field
            where = f" (in {m.group(1)})" if param != field else ""
            return ApiError(f"Unrecognized request argument supplied: {field}{where}", 400, param=param,
                            code="unknown_parameter")
        return ApiError(f"Invalid request: {text}", 400, param=param, code="invalid_value")
    return ApiError(f"Invalid JSON body: {text}", 400, code="invalid_json")


# ---- request pieces ------------------------------------------------------------------------------
class _Strict(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None          # OpenAI's; accepted and ignored (we never obfuscate)


class NightjarOptions(_Strict, kw_only=True):
    """The ``nightjar`` extra: per-request control of speculation.

    ``{"speculate": false}`` or ``{"policy": "off"}``: this request never drafts. The engine-wide
    policy is chosen at start-up, so "off" is the only per-request policy.
    """
    policy: str | None = None
    speculate: bool | None = None


class ContentPart(_Strict, kw_only=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    refusal: str | None = None


PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class _SamplingRequest(_Strict, kw_only=True):
    """Fields shared by chat and text completions."""
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    nightjar: NightjarOptions | None = None
    # accepted, validated, not implemented
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise ApiError("n must be 1: this server returns one choice per request", 400, param="n",
                           code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise unsupported(name, f"{name} is not supported (it must be 0 or absent)")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed when stream is true", 400, param="stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def speculate(self) -> bool:
        """Whether this request may speculate; raises a 400 for a per-request policy other than off."""
        opts = self.nightjar
        if opts is None:
            return True
        off_by_policy = False
        if opts.policy is not None:
            if opts.policy.strip().lower() != "off":
                raise ApiError(f"nightjar.policy {opts.policy!r} is not supported per request: only \"off\" "
                               f"(do not speculate) is; the engine's policy is set at start-up", 400,
                               param="nightjar.policy", code="unsupported_parameter")
            off_by_policy = True
        if opts.speculate is True and off_by_policy:
            raise ApiError("nightjar.speculate=true contradicts nightjar.policy=\"off\"", 400,
                           param="nightjar.speculate")
        return not (off_by_policy or opts.speculate is False)


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None

    def check(self) -> None:
        self.check_common()
        if self.logprobs:
            raise unsupported("logprobs", "logprobs are not supported")
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        rf = self.response_format
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text" and len(rf) == 1):
            raise unsupported("response_format", "response_format is not supported (only {\"type\": \"text\"})")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise unsupported(name, f"{name} (function calling) is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name)
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "modalities other than [\"text\"] are not supported")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as template input: text only; developer is system; tool turns are refused."""
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role in ("tool", "function") or m.tool_calls or m.tool_call_id:
                raise unsupported(f"{where}.role", "tool and function messages are not supported")
            if m.content is None:
                if m.role != "assistant":
                    raise ApiError(f"{where}.content is required", 400, param=f"{where}.content")
                text = ""
            elif isinstance(m.content, str):
                text = m.content
            else:
                parts = []
                for j, p in enumerate(m.content):
                    if p.type != "text" or p.text is None:
                        raise unsupported(f"{where}.content[{j}]",
                                          f"content part type {p.type!r} is not supported (only text parts)")
                    parts.append(p.text)
                text = "\n".join(parts)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        return out


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.logprobs is not None and self.logprobs is not False:
            raise unsupported("logprobs", "logprobs are not supported")
        if self.echo:
            raise unsupported("echo")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "best_of is not supported (it must be 1 or absent)")
        if self.suffix:
            raise unsupported("suffix")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        """One prompt: a string, a list of one string, a token-id list, or a list of one token-id list."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise ApiError("prompt must not be empty", 400, param="prompt")
            return p
        if not p:
            raise ApiError("prompt must not be empty", 400, param="prompt")
        if all(type(t) is int for t in p):
            if any(t < 0 for t in p):
                raise ApiError("prompt token ids must be >= 0", 400, param="prompt")
            return p
        raise ApiError("prompt must be a string, a list of one string, or a list of token ids "
                       "(batched prompts are not supported: send one request per prompt)", 400, param="prompt")


# ---- responses ------------------------------------------------------------------------------------
class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class CompletionChoice(Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "nightjar"
    max_model_len: int | None = None


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
