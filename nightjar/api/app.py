"""OpenAI-compatible aiohttp server: app factory (engine lifecycle in ``cleanup_ctx``), routes, SSE.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Every error is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from nightjar.api.connections import ConnectionGuard, GuardedSite, ParserErrorLog, ServerLimits
from nightjar.api.heap import trim_when_idle
from nightjar.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
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

_ENCODER = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_ENCODE_IN_THREAD_CHARS = 16_384       # tokenizing/templating bigger prompts goes off the event loop
# One chat message costs about as much to template and tokenize as 46 content characters (SmolLM2's
# template on the 2-core box: 30k empty messages render in 163 ms and encode in 527 ms, 16k characters
# of content encode in 7.6 ms); counted as 64 so that 256 empty messages already leave the loop.
_CHARS_PER_MESSAGE = 64
RETRY_AFTER_S = "1"


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


STATE = web.AppKey("nightjar_state", ServerState)
STATE_LIMIT = web.AppKey("nightjar_max_body_bytes", int)


# ---- responses and errors --------------------------------------------------------------------------
def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_ENCODER.encode(obj), status=status, headers=headers, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body, err.status, err.headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        if e.status == 413:
            message = f"request body too large: the limit is {request.app[STATE_LIMIT]} bytes"
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return error_response(ApiError(message, e.status, code=_HTTP_CODES.get(e.status), headers=headers))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never crash on input: a bug becomes a 500 with a log line
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(f"internal error: {type(e).__name__}", 500, code="internal_error"))


@web.middleware
async def connection_middleware(request: web.Request, handler):
    """Marks the connection busy while the app handles its request (no head deadline meanwhile)."""
    guard = request.app[STATE].guard
    conn = guard.request_started(request)
    try:
        return await handler(request)
    finally:
        guard.request_finished(conn)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE].api_key
    if key and (request.path == "/v1" or request.path.startswith("/v1/")):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError("Missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError("Incorrect API key provided", 401, code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def read_json(request: web.Request, kind: type):
    ctype = request.headers.get("Content-Type")
    if ctype is not None:
        mime = request.content_type
        if mime != "application/json" and not mime.endswith("+json"):
            raise ApiError(f"Content-Type must be application/json (got {ctype!r})", 415, code="unsupported_media_type")
    limit = request.app[STATE_LIMIT]
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(f"request body too large: {request.content_length} bytes; the limit is {limit} bytes",
                       413, code="request_too_large")
    body = await read_body(request)
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


async def read_body(request: web.Request) -> bytes:
    """The whole body within the body deadline; a client too slow for it gets a 408 and is disconnected."""
    guard = request.app[STATE].guard
    seconds = guard.limits.body_timeout_s
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except RequestPayloadError as e:           # e.g. a Content-Encoding that does not decode
        cause = e.__cause__ or e
        why = " ".join(str(getattr(cause, "message", "") or cause).split())[:200] or type(cause).__name__
        raise ApiError(f"could not read the request body: {why}", 400, code="invalid_body") from None
    except TimeoutError:
        log.info("dropped client %s: request body not received within %g s", request.remote, seconds)
        guard.drop_after_response(guard.connection_of(request))
        raise ApiError(f"request body not received within {seconds:g} s", 408, code="request_timeout",
                       headers={"Connection": "close"}) from None


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


async def _start(request: web.Request, kind: type) -> tuple[Any, Generation, RequestOutput]:
    t0 = time.monotonic()
    st = request.app[STATE]
    req = await read_json(request, kind)
    st.check_model(req.model)
    speculate = req.speculate
    prompt = req.chat_messages() if kind is ChatCompletionRequest else req.prompt_input()
    st.check_ready()
    if kind is ChatCompletionRequest and len(prompt) >= st.context_len:     # each message is >= 1 token
        raise ApiError(f"{len(prompt)} messages cannot fit the context of {st.context_len} tokens", 400,
                       param="messages", code="context_length_exceeded")
    ids = await st.encode(prompt, _prepare_prompt_size(prompt))
    params = st.sampling(req, len(ids))
    gen = Generation(st, ids, params, speculate, t0, "messages" if kind is ChatCompletionRequest else "prompt")
    return req, gen, await gen.first()


# ---- SSE -------------------------------------------------------------------------------------------
class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)

    async def open(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.resp.write(b"data: " + _ENCODER.encode(obj) + b"\n\n")
        await asyncio.sleep(0)            # let other requests' fan-out run between chunks

    async def done(self) -> None:
        await self.resp.write(_DONE)


async def _stream(request: web.Request, req, gen: Generation, first: RequestOutput, make_chunk, head=None):
    """Shared SSE loop: optional head chunk, merged deltas, optional usage chunk, ``[DONE]``."""
    sse = SSEWriter(request)
    collector = DeltaCollector(gen.outputs, first)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        await sse.open()
        if head is not None:
            await sse.send(head)
        try:
            while (out := await collector.next()) is not None:
                gen.update(out)
                if out.text_delta or out.finished:
                    await sse.send(make_chunk(out.text_delta, out.finish_reason, include_usage))
                if out.finished:
                    break
        except (EngineError, RequestError) as e:
            err = ApiError(f"engine error: {e}", 503, code="engine_unavailable")
            await sse.send(err.body)
            await sse.done()
            return sse.resp
        if include_usage:
            await sse.send(make_chunk(None, None, include_usage, usage=gen.usage))
        await sse.done()
    except ConnectionError:          # the client went away: closing the collector aborts the request
        log.debug("client disconnected mid-stream")
    finally:
        await collector.aclose()
        gen.record()
    return sse.resp


# ---- handlers --------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req, gen, first = await _start(request, ChatCompletionRequest)
    st: ServerState = request.app[STATE]
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name
    if not req.stream:
        last = await gen.collect(first)
        return json_response(ChatCompletion(
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
    return await _stream(request, req, gen, first, chunk, head)


async def completions(request: web.Request) -> web.StreamResponse:
    req, gen, first = await _start(request, CompletionRequest)
    st: ServerState = request.app[STATE]
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name
    if not req.stream:
        last = await gen.collect(first)
        return json_response(Completion(
            id=rid, created=created, model=model, usage=gen.usage,
            choices=[CompletionChoice(text=last.text, finish_reason=last.finish_reason)]))

    def chunk(text, finish, include_usage, usage=None):
        choices = [] if usage is not None else [CompletionChoice(text=text or "", finish_reason=finish)]
        return Completion(id=rid, created=created, model=model, choices=choices,
                          usage=usage if include_usage else msgspec.UNSET)

    return await _stream(request, req, gen, first, chunk)


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return json_response(ModelList(data=[ModelCard(id=st.model_name, created=st.created,
                                                   max_model_len=st.context_len)]))


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.check_model(request.match_info["model"])
    return json_response(ModelCard(id=st.model_name, created=st.created, max_model_len=st.context_len))


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.engine.healthy:
        return json_response({"status": "ok"})
    return error_response(ApiError("the engine is not running", 503, code="engine_unavailable"))


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.attach()
    return web.Response(body=st.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


# ---- factory ---------------------------------------------------------------------------------------
async def _lifecycle(app: web.Application):
    st = app[STATE]
    trimmer = None
    if st.owned:
        await st.engine.start()
        log.info("engine started: model %s, policy %s, %d KV blocks", st.model_name, st.engine.config.policy,
                 st.engine.allocator.num_total)
        trimmer = asyncio.create_task(trim_when_idle(st.engine), name="nightjar:heap-trim")
    st.attach()
    yield
    st.detach()
    if trimmer is not None:
        trimmer.cancel()
        await asyncio.gather(trimmer, return_exceptions=True)
    if st.owned:
        await st.engine.stop()
        log.info("engine stopped")


def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               served_engine_owned: bool = False, limits: ServerLimits | None = None) -> web.Application:
    """The OpenAI-compatible app for ``engine``. When ``served_engine_owned``, the app starts and stops it.
    ``limits`` (connections, read deadlines) apply fully when the app runs on a ``GuardedSite``."""
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[connection_middleware, error_middleware, auth_middleware])
    gamma_max = getattr(getattr(engine, "config", None), "gamma_max", 8)
    app[STATE] = ServerState(engine=engine, model_name=model_name, api_key=api_key or None,
                             owned=served_engine_owned, metrics=ServerMetrics(gamma_max),
                             guard=ConnectionGuard(limits or ServerLimits()))
    app[STATE_LIMIT] = max_body_bytes
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_guarded(app: web.Application, host: str | None, port: int, *, access_log=None,
                        handle_signals: bool = False) -> tuple[web.AppRunner, GuardedSite]:
    """Run ``app`` on a ``GuardedSite``: its connection cap and read deadlines, aiohttp's keep-alive timeout,
    handler cancellation, and one INFO line for a request aiohttp's parser rejects."""
    guard = app[STATE].guard
    runner = web.AppRunner(app, handle_signals=handle_signals, handler_cancellation=True, access_log=access_log,
                           keepalive_timeout=guard.limits.keepalive_timeout_s, logger=ParserErrorLog())
    await runner.setup()
    site = GuardedSite(runner, host, port, guard)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


async def _serve_forever(app: web.Application, host: str, port: int, access_log) -> None:
    runner, site = await start_guarded(app, host, port, access_log=access_log, handle_signals=True)
    gc.collect()
    gc.freeze()          # the engine's start-up objects leave the collector's scans: shorter gen-2 pauses
    try:
        limits = app[STATE].guard.limits
        log.info("serving on %s (at most %d connections; request head %g s, body %g s) - Ctrl+C to stop",
                 site.name, limits.max_connections, limits.header_timeout_s, limits.body_timeout_s)
        await asyncio.Event().wait()              # until SIGINT/SIGTERM raise GracefulExit
    finally:
        await runner.cleanup()


def serve(engine_kwargs: dict, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          trace: str | None = None, log_level: str = "info", limits: ServerLimits | None = None) -> None:
    """Build the engine from ``engine_kwargs`` and serve it until SIGINT/SIGTERM (uvloop when available).

    ``engine_kwargs["served_model_name"]`` (optional) names the model in responses; default: ``model``.
    """
    from nightjar.engine import Engine
    from nightjar.kernel.config import EngineConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = dict(engine_kwargs)
    model_name = str(kwargs.pop("served_model_name", None) or kwargs.get("model", EngineConfig().model))
    if trace is not None:
        kwargs["trace"] = trace
    engine = Engine(**kwargs)
    app = create_app(engine, model_name, api_key=api_key, served_engine_owned=True, limits=limits)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    access_log = logging.getLogger("aiohttp.access") if log_level.lower() == "debug" else None
    main = loop.create_task(_serve_forever(app, host, port, access_log))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        main.cancel()
        loop.run_until_complete(asyncio.gather(main, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
