"""Framework-neutral OpenAI request handling, shared by the aiohttp server (``api/app.py``) and the Ray Serve
replicas (``nightjar/deploy``): routing, auth, body parsing and validation, one generation, and the reply
shaped as a JSON object (:class:`JsonReply`) or as an async iterator of SSE frames (:func:`sse_frames`).

Nothing here imports a web framework: a front end reads the request, calls these functions, and writes
what they return. Every error is an :class:`ApiError` whose ``body`` is OpenAI-shaped.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec

from nightjar.api.connections import ConnectionGuard, ServerLimits
from nightjar.api.metrics import ServerMetrics
from nightjar.api.schemas import (
    ApiError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    decode_error,
)
from nightjar.api.stream import DeltaCollector
from nightjar.kernel.messages import DraftOffloaded, DraftReloaded, DraftResidency, PoolResized
from nightjar.sampling import EngineError, RequestError, RequestOutput, SamplingParams

log = logging.getLogger("nightjar.api")

ENCODER = msgspec.json.Encoder()
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_ENCODE_IN_THREAD_CHARS = 16_384       # tokenizing/templating bigger prompts goes off the event loop
# One chat message costs about as much to template and tokenize as 46 content characters (SmolLM2's
# template on the 2-core box: 30k empty messages render in 163 ms and encode in 527 ms, 16k characters
# of content encode in 7.6 ms); counted as 64 so that 256 empty messages already leave the loop.
_CHARS_PER_MESSAGE = 64
RETRY_AFTER_S = "1"

# (path, method) -> route name; ``/v1/models/{model}`` is matched by prefix in :func:`route`.
ROUTES = {"/v1/chat/completions": {"POST": "chat"}, "/v1/completions": {"POST": "completions"},
          "/v1/models": {"GET": "models"}, "/health": {"GET": "health"}, "/metrics": {"GET": "metrics"}}
POST_ROUTES = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


# ---- state -----------------------------------------------------------------------------------------
class StateLogger:
    """One readable log line per draft-residency or pool-size change (a bus tap; never raises)."""

    def __init__(self) -> None:
        self.resident: bool | None = None

    def tap(self, env) -> None:
        m = env.msg
        try:
            match m:
                case DraftOffloaded():
                    log.info("draft offloaded: %.1f MiB in %.1f ms, pool may grow by %d blocks",
                             m.bytes_moved / 2**20, m.duration_s * 1e3, m.freed_blocks)
                case DraftReloaded():
                    log.info("draft reloaded: %.1f MiB in %.1f ms", m.bytes_moved / 2**20, m.duration_s * 1e3)
                case PoolResized():
                    log.info("KV pool resized by %+d blocks to %d (%d migrated, %.1f ms)",
                             m.delta, m.num_total, m.migrated, m.duration_s * 1e3)
                case DraftResidency():
                    if m.resident != self.resident:
                        self.resident = m.resident
                        log.info("draft %s (%s)", "resident" if m.resident else "not resident", m.state)
        except Exception:  # a tap runs inside Bus.publish: it must never raise
            pass


@dataclass
class ServerState:
    engine: Any
    model_name: str
    api_key: str | None
    owned: bool
    metrics: ServerMetrics
    guard: ConnectionGuard = field(default_factory=lambda: ConnectionGuard(ServerLimits()))
    created: int = field(default_factory=lambda: int(time.time()))
    states: StateLogger = field(default_factory=StateLogger)
    attached: bool = False

    def attach(self) -> None:
        """Tap the engine's bus once it exists (the engine builds its bus in ``start()``)."""
        if self.attached or not getattr(self.engine, "started", False):
            return
        self.metrics.attach(self.engine)
        self.engine.bus.add_tap(self.states.tap)
        self.attached = True

    def detach(self) -> None:
        if not self.attached:
            return
        self.metrics.detach()
        try:
            self.engine.bus.remove_tap(self.states.tap)
        except ValueError:
            pass
        self.attached = False

    @property
    def context_len(self) -> int:
        """The context the engine honours for every request (``Engine.max_model_len`` once started)."""
        e = self.engine
        limit = getattr(e, "max_model_len", None) if getattr(e, "started", False) else None
        if limit is not None:
            return limit
        n = e.config.max_model_len
        target = getattr(e, "target", None)
        return min(n, target.config.max_position) if target is not None else n

    def check_ready(self) -> None:
        if not self.engine.healthy:
            raise ApiError("the engine is not running", 503, code="engine_unavailable")
        self.attach()

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise ApiError(f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           404, param="model", code="model_not_found")

    async def encode(self, prompt, size: int) -> list[int]:
        try:
            if size > _ENCODE_IN_THREAD_CHARS:
                return await asyncio.to_thread(self.engine.encode, prompt)
            return self.engine.encode(prompt)
        except Exception as e:
            raise ApiError(f"could not tokenize the prompt: {e}", 400,
                           param="messages" if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict)
                           else "prompt") from e

    def sampling(self, req: ChatCompletionRequest | CompletionRequest, num_prompt: int) -> SamplingParams:
        left = self.context_len - num_prompt
        max_tokens = req.requested_max_tokens
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = max(left, 1)         # too long a prompt: the engine's admission rejects it (400)
        elif left >= 1 and max_tokens > left:
            raise ApiError(f"{param} is too large: {max_tokens} (the prompt has {num_prompt} tokens and the "
                           f"context is {self.context_len} tokens, so at most {left} can be generated)",
                           400, param=param, code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise ApiError(f"min_tokens ({req.min_tokens}) must be <= {param} ({max_tokens})", 400, param="min_tokens")
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=req.seed, stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)


# ---- the edge: route, auth, content type, body -------------------------------------------------------
@dataclass
class JsonReply:
    obj: Any
    status: int = 200
    headers: dict[str, str] | None = None

    def encode(self) -> bytes:
        return ENCODER.encode(self.obj)


def error_reply(err: ApiError) -> JsonReply:
    return JsonReply(err.body, err.status, err.headers)


def route(method: str, path: str) -> tuple[str, str | None]:
    """``(route name, path argument)`` for a request, or a 404 / 405 ApiError (as the aiohttp router gives)."""
    methods, arg = ROUTES.get(path), None
    if methods is None and path.startswith("/v1/models/") and "/" not in path[len("/v1/models/"):]:
        methods, arg = {"GET": "model"}, path[len("/v1/models/"):]
    if methods is None:
        raise ApiError("Not Found", 404, code="not_found")
    name = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
    if name is None:
        allow = ",".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
        raise ApiError("Method Not Allowed", 405, code="method_not_allowed", headers={"Allow": allow})
    return name, arg


def check_auth(api_key: str | None, path: str, authorization: str | None) -> None:
    if not api_key or not (path == "/v1" or path.startswith("/v1/")):
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError("Missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError("Incorrect API key provided", 401, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def check_content_type(ctype: str | None, mime: str | None = None) -> None:
    """415 unless the body is JSON; ``mime`` is ``ctype`` without parameters (parsed here when not given)."""
    if ctype is None:
        return
    mime = mime if mime is not None else ctype.split(";", 1)[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise ApiError(f"Content-Type must be application/json (got {ctype!r})", 415, code="unsupported_media_type")


def too_large(limit: int, size: int | None = None) -> ApiError:
    if size is None:
        return ApiError(f"request body too large: the limit is {limit} bytes", 413, code="request_too_large")
    return ApiError(f"request body too large: {size} bytes; the limit is {limit} bytes", 413,
                    code="request_too_large")


def decode_body(body: bytes, kind: type):
    """The request object for a JSON ``body``, validated (400 with the offending ``param`` otherwise)."""
    if not body.strip():
        raise ApiError("request body is empty: expected a JSON object", 400, code="invalid_json")
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.MsgspecError as e:
        raise decode_error(e) from None
    except RecursionError:
        raise ApiError("Invalid JSON body: nested too deeply", 400, code="invalid_json") from None
    req.check()
    return req


# ---- one generation ------------------------------------------------------------------------------
class Generation:
    """One engine request seen from HTTP: rejection mapping, output accounting and latency metrics."""

    def __init__(self, st: ServerState, ids: list[int], params: SamplingParams, speculate: bool, t0: float,
                 prompt_param: str = "prompt"):
        self.st, self.t0, self.prompt_param = st, t0, prompt_param
        self.outputs = st.engine.generate(ids, params, speculate=speculate)
        self.num_prompt, self.num_output = len(ids), 0
        self.ttft: float | None = None
        self.finish: str | None = None
        self.recorded = False

    async def first(self) -> RequestOutput:
        """The first output; a rejection by the engine (400 / 429 / 503) becomes an ApiError."""
        try:
            out = await self.outputs.__anext__()
        except RequestError as e:
            self.st.metrics.observe_rejection(e.status)
            self.recorded = True
            headers = {"Retry-After": RETRY_AFTER_S} if e.status == 429 else None
            code = {429: "rate_limit_exceeded", 503: "engine_unavailable"}.get(e.status, "invalid_request")
            param = None
            if e.status == 400 and "context" in str(e):
                code, param = "context_length_exceeded", self.prompt_param
            raise ApiError(str(e), e.status, code=code, param=param, headers=headers) from None
        except EngineError as e:
            self.recorded = True
            raise ApiError(f"engine error: {e}", 503, code="engine_unavailable") from None
        except StopAsyncIteration:
            self.recorded = True
            raise ApiError("the engine ended the request without output", 503, code="engine_unavailable") from None
        self.ttft = time.monotonic() - self.t0
        self.update(out)
        return out

    def update(self, out: RequestOutput) -> None:
        self.num_prompt, self.num_output = out.num_prompt_tokens or self.num_prompt, out.num_output_tokens
        if out.finish_reason:
            self.finish = out.finish_reason

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt, completion_tokens=self.num_output,
                     total_tokens=self.num_prompt + self.num_output)

    def record(self) -> None:
        if self.recorded:
            return
        self.recorded = True
        self.st.metrics.observe_request(self.ttft, time.monotonic() - self.t0, self.num_prompt, self.num_output,
                                        self.finish or "abort")

    async def collect(self, first: RequestOutput) -> RequestOutput:
        """Non-streaming: run to the end. Cancellation (client gone) closes the iterator, which aborts."""
        last = first
        try:
            if not first.finished:
                async for out in self.outputs:
                    self.update(out)
                    last = out
        except EngineError as e:
            raise ApiError(f"engine error: {e}", 503, code="engine_unavailable") from None
        except RequestError as e:
            raise ApiError(str(e), e.status) from None
        finally:
            await self.outputs.aclose()
            self.record()
        return last


def _prepare_prompt_size(prompt) -> int:
    """Work to template and tokenize ``prompt``, in content characters: a chat message counts for its
    content plus ``_CHARS_PER_MESSAGE`` (many empty messages cost as much as one long one)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"]) + len(m["role"]) + _CHARS_PER_MESSAGE for m in prompt)
    return len(prompt)


async def start(st: ServerState, req, t0: float) -> tuple[Generation, RequestOutput]:
    """Model and context checks, tokenization, sampling parameters, and the first output of ``req``."""
    chat = isinstance(req, ChatCompletionRequest)
    st.check_model(req.model)
    prompt = req.chat_messages() if chat else req.prompt_input()
    st.check_ready()
    if chat and len(prompt) >= st.context_len:     # each message is >= 1 token
        raise ApiError(f"{len(prompt)} messages cannot fit the context of {st.context_len} tokens", 400,
                       param="messages", code="context_length_exceeded")
    ids = await st.encode(prompt, _prepare_prompt_size(prompt))
    params = st.sampling(req, len(ids))
    gen = Generation(st, ids, params, req.speculate, t0, "messages" if chat else "prompt")
    return gen, await gen.first()


# ---- replies ---------------------------------------------------------------------------------------
def sse(obj: Any) -> bytes:
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


async def sse_frames(req, gen: Generation, first: RequestOutput, make_chunk, head=None) -> AsyncIterator[bytes]:
    """The SSE frames of one stream: optional head chunk, merged deltas, optional usage chunk, ``[DONE]``.
    An engine failure mid-stream becomes one OpenAI error frame before ``[DONE]``. Closing the iterator
    (the client went away) aborts the request."""
    collector = DeltaCollector(gen.outputs, first)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        if head is not None:
            yield sse(head)
        try:
            while (out := await collector.next()) is not None:
                gen.update(out)
                if out.text_delta or out.finished:
                    yield sse(make_chunk(out.text_delta, out.finish_reason, include_usage))
                if out.finished:
                    break
        except (EngineError, RequestError) as e:
            yield sse(ApiError(f"engine error: {e}", 503, code="engine_unavailable").body)
            yield DONE
            return
        if include_usage:
            yield sse(make_chunk(None, None, include_usage, usage=gen.usage))
        yield DONE
    finally:
        await collector.aclose()
        gen.record()


async def chat_completion(st: ServerState, req: ChatCompletionRequest, t0: float):
    """A :class:`JsonReply`, or (``stream``) an async iterator of SSE frames."""
    gen, first = await start(st, req, t0)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name
    if not req.stream:
        last = await gen.collect(first)
        return JsonReply(ChatCompletion(
            id=rid, created=created, model=model, usage=gen.usage,
            choices=[ChatChoice(message=ChatMessageOut(role="assistant", content=last.text),
                                finish_reason=last.finish_reason)]))

    def chunk(text, finish, include_usage, usage=None):
        choices = [] if usage is not None else [
            ChatChunkChoice(delta=Delta(content=text) if text else Delta(), finish_reason=finish)]
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                   usage=usage if include_usage else msgspec.UNSET)

    head = ChatCompletionChunk(id=rid, created=created, model=model,
                               choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))],
                               usage=None if req.stream_options and req.stream_options.include_usage else msgspec.UNSET)
    return sse_frames(req, gen, first, chunk, head)


async def completion(st: ServerState, req: CompletionRequest, t0: float):
    """A :class:`JsonReply`, or (``stream``) an async iterator of SSE frames."""
    gen, first = await start(st, req, t0)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name
    if not req.stream:
        last = await gen.collect(first)
        return JsonReply(Completion(
            id=rid, created=created, model=model, usage=gen.usage,
            choices=[CompletionChoice(text=last.text, finish_reason=last.finish_reason)]))

    def chunk(text, finish, include_usage, usage=None):
        choices = [] if usage is not None else [CompletionChoice(text=text or "", finish_reason=finish)]
        return Completion(id=rid, created=created, model=model, choices=choices,
                          usage=usage if include_usage else msgspec.UNSET)

    return sse_frames(req, gen, first, chunk)


def models(st: ServerState) -> JsonReply:
    return JsonReply(ModelList(data=[ModelCard(id=st.model_name, created=st.created, max_model_len=st.context_len)]))


def model(st: ServerState, name: str) -> JsonReply:
    st.check_model(name)
    return JsonReply(ModelCard(id=st.model_name, created=st.created, max_model_len=st.context_len))


def health(st: ServerState) -> JsonReply:
    if st.engine.healthy:
        return JsonReply({"status": "ok"})
    return error_reply(ApiError("the engine is not running", 503, code="engine_unavailable"))


async def handle(st: ServerState, name: str, arg: str | None, body: bytes | None, t0: float):
    """Run route ``name`` (from :func:`route`) after the edge checks: a JsonReply or an SSE iterator.
    ``body`` is the raw JSON of a POST route. Raises ApiError."""
    if name in POST_ROUTES:
        req = decode_body(body or b"", POST_ROUTES[name])
        return await (chat_completion if name == "chat" else completion)(st, req, t0)
    if name == "models":
        return models(st)
    if name == "model":
        return model(st, arg or "")
    if name == "health":
        return health(st)
    raise ApiError("Not Found", 404, code="not_found")
