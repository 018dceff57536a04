"""OpenAI-compatible aiohttp server: app factory (engine lifecycle in ``cleanup_ctx``), routes, SSE.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Every error is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from nightjar.api import core
from nightjar.api.connections import ConnectionGuard, GuardedSite, ParserErrorLog, ServerLimits
from nightjar.api.core import (  # noqa: F401  (re-exported: tests and older callers import them from here)
    RETRY_AFTER_S,
    Generation,
    JsonReply,
    ServerState,
    StateLogger,
    _prepare_prompt_size,
)
from nightjar.api.heap import trim_when_idle
from nightjar.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nightjar.api.metrics import ServerMetrics
from nightjar.api.schemas import ApiError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("nightjar.api")


STATE = web.AppKey("nightjar_state", ServerState)
STATE_LIMIT = web.AppKey("nightjar_max_body_bytes", int)


# ---- responses and errors --------------------------------------------------------------------------
def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=core.ENCODER.encode(obj), status=status, headers=headers,
                        content_type="application/json")


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
    core.check_auth(request.app[STATE].api_key, request.path, request.headers.get("Authorization"))
    return await handler(request)


async def read_json(request: web.Request, kind: type):
    ctype = request.headers.get("Content-Type")
    core.check_content_type(ctype, request.content_type if ctype is not None else None)
    limit = request.app[STATE_LIMIT]
    if request.content_length is not None and request.content_length > limit:
        raise core.too_large(limit, request.content_length)
    return core.decode_body(await read_body(request), kind)


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


# ---- handlers --------------------------------------------------------------------------------------
async def _stream(request: web.Request, frames) -> web.StreamResponse:
    """Write the SSE ``frames`` (from ``core.sse_frames``); a client that goes away closes them (abort)."""
    resp = web.StreamResponse(status=200, headers=core.SSE_HEADERS)
    try:
        await resp.prepare(request)
        async for frame in frames:
            await resp.write(frame)
            await asyncio.sleep(0)            # let other requests' fan-out run between chunks
    except ConnectionError:          # the client went away: closing the frames aborts the request
        log.debug("client disconnected mid-stream")
    finally:
        await frames.aclose()
    return resp


async def _reply(request: web.Request, reply) -> web.StreamResponse:
    if isinstance(reply, JsonReply):
        return json_response(reply.obj, reply.status, reply.headers)
    return await _stream(request, reply)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic()
    req = await read_json(request, ChatCompletionRequest)
    return await _reply(request, await core.chat_completion(request.app[STATE], req, t0))


async def completions(request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic()
    req = await read_json(request, CompletionRequest)
    return await _reply(request, await core.completion(request.app[STATE], req, t0))


async def list_models(request: web.Request) -> web.Response:
    return await _reply(request, core.models(request.app[STATE]))


async def get_model(request: web.Request) -> web.Response:
    return await _reply(request, core.model(request.app[STATE], request.match_info["model"]))


async def health(request: web.Request) -> web.Response:
    return await _reply(request, core.health(request.app[STATE]))


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
