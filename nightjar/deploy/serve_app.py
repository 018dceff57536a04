"""The Ray Serve application: an ``Ingress`` deployment (HTTP edge) in front of ``EngineReplica``
deployments (one ``nightjar.Engine`` each).

The ingress does what needs no engine (routing, auth, content type, body size) with the functions the
aiohttp server uses (``nightjar.api.core``), then streams the raw body to one engine replica through a Serve
``DeploymentHandle`` (Serve's router picks the replica: power of two choices over ongoing requests). The
replica parses, validates and generates with the same ``core`` functions and yields a head
(status, headers, whether SSE) followed by the body bytes. A replica that dies before its head is retried
on another replica (``RETRIES``), then gives a 503 ``replica_failed``; one that dies mid-stream ends that
stream with an OpenAI error frame and ``[DONE]`` (its tokens already reached the client: no retry).

Per-replica metrics: each replica pushes its own Prometheus exposition to a small named actor every
``METRICS_PUSH_S``; the ingress's ``GET /metrics`` merges the fresh ones with a ``replica`` label.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from nightjar.api import core
from nightjar.api.heap import trim_when_idle
from nightjar.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nightjar.api.metrics import ServerMetrics
from nightjar.api.schemas import ApiError
from nightjar.deploy.metrics_merge import merge_replica_metrics

log = logging.getLogger("nightjar.deploy")

BOARD_NAMESPACE = "nightjar"
METRICS_PUSH_S = 2.0
REPLICA_HEADER = "X-Nightjar-Replica"     # which replica answered (its Serve replica id)
METRICS_MAX_AGE_S = 10.0    # a replica silent this long (dead, restarting) leaves GET /metrics
# A replica that fails before its first reply byte: the request goes to another one (nothing reached the
# client yet), at most RETRIES times, RETRY_DELAY_S apart (Serve's router learns of the death meanwhile).
RETRIES = 2
RETRY_DELAY_S = 0.25


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest Prometheus exposition of each replica, with when it arrived."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        now = time.monotonic()
        self.texts = {r: v for r, v in self.texts.items() if now - v[0] <= max_age_s}
        return {r: text for r, (_, text) in self.texts.items()}


def metrics_board(name: str):
    return MetricsBoard.options(name=name, namespace=BOARD_NAMESPACE, lifetime="detached",
                                get_if_exists=True).remote()


def _json(reply: core.JsonReply) -> Response:
    return Response(reply.encode(), status_code=reply.status, headers=reply.headers,
                    media_type="application/json")


class EngineReplica:
    """One Serve replica: one started ``nightjar.Engine`` and the shared request handling."""

    async def __init__(self, engine_kwargs: dict, model_name: str, board_name: str | None = None):
        from nightjar.engine import Engine

        self.engine = Engine(**engine_kwargs)
        await self.engine.start()
        gamma_max = getattr(self.engine.config, "gamma_max", 8)
        self.st = core.ServerState(engine=self.engine, model_name=model_name, api_key=None, owned=True,
                                   metrics=ServerMetrics(gamma_max))
        self.st.attach()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.trimmer = asyncio.create_task(trim_when_idle(self.engine), name="nightjar:heap-trim")  # as `serve`
        self.pusher = None
        if board_name is not None:
            self.pusher = asyncio.create_task(self._push_metrics(board_name), name="nightjar:metrics-push")
        log.info("replica %s: engine started (model %s, policy %s)", self.replica_id, model_name,
                 self.engine.config.policy)

    async def _push_metrics(self, board_name: str) -> None:
        board = ray.get_actor(board_name, namespace=BOARD_NAMESPACE)
        while True:
            try:
                await board.put.remote(self.replica_id, self.st.metrics.render().decode())
            except Exception as e:  # the board is best effort: metrics must never take a replica down
                log.debug("metrics push failed: %s", e)
            await asyncio.sleep(METRICS_PUSH_S)

    async def call(self, name: str, arg: str | None, body: bytes | None):
        """Yields ``{"status", "headers", "sse"}`` then the body: one JSON bytes, or SSE frames."""
        t0 = time.monotonic()
        try:
            reply = await core.handle(self.st, name, arg, body, t0)
        except ApiError as e:
            reply = core.error_reply(e)
        except Exception as e:  # never crash on input: a bug becomes a 500 with a log line
            log.exception("unhandled error on %s", name)
            reply = core.error_reply(ApiError(f"internal error: {type(e).__name__}", 500, code="internal_error"))
        if isinstance(reply, core.JsonReply):
            yield {"status": reply.status, "headers": reply.headers, "sse": False, "replica": self.replica_id}
            yield reply.encode()
            return
        yield {"status": 200, "headers": None, "sse": True, "replica": self.replica_id}
        try:
            async for frame in reply:
                yield frame
        finally:
            await reply.aclose()

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the engine is not running")

    async def __del__(self):
        """Serve's shutdown hook; also called for a replica stopped while ``__init__`` was still running."""
        pusher, trimmer, st, engine = (getattr(self, k, None) for k in ("pusher", "trimmer", "st", "engine"))
        for task in (pusher, trimmer):
            if task is not None:
                task.cancel()
        if st is not None:
            st.detach()
        if engine is not None and getattr(engine, "started", False):
            await engine.stop()


class Ingress:
    """The HTTP edge: checks that need no engine, then one engine replica per request."""

    def __init__(self, engine, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 board_name: str | None = None):
        self.engine = engine
        self.api_key, self.limit, self.board_name = api_key or None, max_body_bytes, board_name

    async def __call__(self, request: Request) -> Response:
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):           # an app deployed under a route prefix
            path = path[len(root):] or "/"
        try:
            core.check_auth(self.api_key, path, request.headers.get("authorization"))
            name, arg = core.route(request.method, path)
            if name == "metrics":
                return await self.metrics()
            body = await self.read_body(request) if name in core.POST_ROUTES else None
            return await self.forward(name, arg, body)
        except ApiError as e:
            return _json(core.error_reply(e))

    async def read_body(self, request: Request) -> bytes:
        core.check_content_type(request.headers.get("content-type"))
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.limit:
            raise core.too_large(self.limit, int(size))
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.limit:
                raise core.too_large(self.limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def forward(self, name: str, arg: str | None, body: bytes | None) -> Response:
        for attempt in range(1 + RETRIES):
            stream = self.engine.options(stream=True).call.remote(name, arg, body)
            try:
                head = await stream.__anext__()
                if not head["sse"]:
                    data = b"".join([chunk async for chunk in stream])
                    headers = {**(head["headers"] or {}), REPLICA_HEADER: head["replica"]}
                    return Response(data, status_code=head["status"], headers=headers,
                                    media_type="application/json")
                break
            except Exception as e:      # the replica died or could not be reached; nothing reached the client
                stream.cancel()
                if attempt == RETRIES:
                    raise replica_failed(e) from None
                log.warning("replica failed before answering (%s): retrying on another", type(e).__name__)
                await asyncio.sleep(RETRY_DELAY_S)
        headers = {k: v for k, v in core.SSE_HEADERS.items() if k != "Content-Type"}
        headers[REPLICA_HEADER] = head["replica"]
        return StreamingResponse(self.relay(stream), status_code=200, headers=headers,
                                 media_type="text/event-stream")

    @staticmethod
    async def relay(stream):
        try:
            async for frame in stream:
                yield frame
        except Exception as e:          # the replica died mid-stream: say so, then end the stream
            log.warning("stream lost its replica: %s", type(e).__name__)
            yield core.sse(replica_failed(e).body)
            yield core.DONE
        finally:
            stream.cancel()

    async def metrics(self) -> Response:
        texts = {}
        if self.board_name is not None:
            board = ray.get_actor(self.board_name, namespace=BOARD_NAMESPACE)
            texts = await board.fresh.remote(METRICS_MAX_AGE_S)
        return Response(merge_replica_metrics(texts), headers={"Content-Type": METRICS_CONTENT_TYPE})


def replica_failed(e: BaseException) -> ApiError:
    return ApiError(f"the replica serving this request failed ({type(e).__name__}); retry the request", 503,
                    code="replica_failed")
