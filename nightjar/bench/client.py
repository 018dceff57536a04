"""The async load generator: streaming OpenAI requests over aiohttp, open-loop (arrival schedule) or closed-loop
(N clients back to back), plus a ``/metrics`` poller for the timeline."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from nightjar.bench.datasets import BenchRequest, Tokenizer
from nightjar.bench.metrics import RequestResult, Sample, parse_prometheus, pick_series
from nightjar.offline.arrivals import ArrivalPlan

log = logging.getLogger("nightjar.bench")


@dataclass
class ClientConfig:
    base_url: str                       # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None            # None: omitted from the body (Nightjar then serves its one model)
    endpoint_type: str = "chat"         # "chat" or "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    timeline_interval_s: float = 1.0    # /metrics poll period; 0 disables polling
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    tokenizer: Tokenizer | None = None  # only to count output tokens of servers that send no usage

    @property
    def root(self) -> str:
        u = self.base_url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.endpoint_type == "chat" else "/v1/completions")


def request_body(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.endpoint_type == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _headers(cfg: ClientConfig) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, req: BenchRequest,
                       res: RequestResult, t_origin: float) -> RequestResult:
    """One streamed request; fills ``res`` (times relative to ``t_origin`` / to its own send time)."""
    res.category, res.prompt_len, res.max_tokens = req.category, req.prompt_len, req.max_tokens
    st = time.perf_counter()
    res.start_s = st - t_origin
    text: list[str] = []
    last_chunk = None
    try:
        async with session.post(cfg.url, json=request_body(cfg, req), headers=_headers(cfg)) as resp:
            res.status = resp.status
            if resp.status != 200:
                body = await resp.text()
                try:
                    msg = json.loads(body)["error"]["message"]
                except Exception:
                    msg = body[:300]
                res.error = f"HTTP {resp.status}: {msg}"
                return res
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line or line.startswith(b":") or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                for ch in obj.get("choices") or ():
                    piece = (ch.get("delta") or {}).get("content") if cfg.endpoint_type == "chat" else ch.get("text")
                    fin = ch.get("finish_reason")
                    if piece:
                        text.append(piece)
                        if res.ttft_s is None:
                            res.ttft_s = now - st
                    if (piece or fin) and res.ttft_s is not None:
                        res.chunk_s.append(now - st)
                        last_chunk = now
                    if fin:
                        res.finish_reason = fin
                if usage := obj.get("usage"):
                    res.output_tokens = usage.get("completion_tokens")
                    res.prompt_tokens = usage.get("prompt_tokens")
    except asyncio.CancelledError:
        res.error = "cancelled"
        raise
    except Exception as e:  # network errors, timeouts, bad JSON: the request fails, the run goes on
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    res.text = "".join(text)
    if res.ttft_s is None:            # nothing generated (e.g. a zero-length answer): TTFT = E2E = end of stream
        res.error = res.error or "no output chunk"
        return res
    res.e2e_s = last_chunk - st
    if res.output_tokens is None:
        if cfg.tokenizer is not None:
            res.output_tokens, res.usage_source = len(cfg.tokenizer.encode(res.text)), "tokenizer"
        else:
            res.usage_source = "none"
    res.success = True
    return res


class MetricsPoller:
    """Scrapes ``/metrics`` every ``interval`` s into :class:`Sample` s (the server series of the timeline)."""

    def __init__(self, session: aiohttp.ClientSession, cfg: ClientConfig, t_origin: float):
        self.session, self.cfg, self.t0 = session, cfg, t_origin
        self.samples: list[Sample] = []
        self.errors = 0
        self._task: asyncio.Task | None = None

    async def scrape(self) -> Sample | None:
        try:
            async with self.session.get(self.cfg.root + "/metrics",
                                        timeout=aiohttp.ClientTimeout(
                                            total=max(2.0, self.cfg.timeline_interval_s))) as r:
                if r.status != 200:
                    self.errors += 1
                    return None
                text = await r.text()
        except Exception:
            self.errors += 1
            return None
        s = Sample(time.perf_counter() - self.t0, pick_series(parse_prometheus(text)))
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        k = 1
        while True:
            delay = self.t0 + k * self.cfg.timeline_interval_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                k = int((time.perf_counter() - self.t0) / self.cfg.timeline_interval_s)
            k += 1
            await self.scrape()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self.scrape()            # the closing sample


def _progress(total: int | None, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False)


@dataclass
class RunOutput:
    results: list[RequestResult]
    duration_s: float
    samples: list[Sample]
    scrape_errors: int
    warmup_errors: list[str]


async def warmup(session: aiohttp.ClientSession, cfg: ClientConfig, requests: list[BenchRequest], n: int) -> list[str]:
    """``n`` requests one after another, not measured (first-request costs on a fresh server)."""
    errors = []
    for i in range(n):
        req = requests[i % len(requests)]
        req = BenchRequest(-1, req.prompt, min(req.max_tokens, 16), req.prompt_len, req.category, req.source)
        r = await send_request(session, cfg, req, RequestResult(-1), time.perf_counter())
        if not r.success:
            errors.append(r.error)
    return errors


async def run_load(cfg: ClientConfig, requests: list[BenchRequest], plan: ArrivalPlan, *, num_warmups: int = 0,
                   closed_loop: int | None = None, duration_s: float | None = None,
                   max_requests: int | None = None) -> RunOutput:
    """Open loop: request ``i`` leaves at ``plan.times[i]`` (bounded by ``max_concurrency``: a request waits for a
    free slot, and its latencies start when it is actually sent). Closed loop: ``closed_loop`` clients send
    ``requests`` in order, each the next one as soon as its previous one ends, until ``duration_s`` has passed
    (no request starts after that; running ones finish) or ``max_requests`` have been sent; ``requests`` cycle."""
    limit = cfg.max_concurrency or closed_loop or 0
    connector = aiohttp.TCPConnector(limit=limit if limit else 0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as session:
        warm_errors = await warmup(session, cfg, requests, num_warmups) if num_warmups else []
        t0 = time.perf_counter()
        # the poller has its own session: the load session's connection limit must not starve the scrapes
        poll_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2))
        poller = MetricsPoller(poll_session, cfg, t0)
        if cfg.timeline_interval_s and cfg.timeline_interval_s > 0:
            first = await poller.scrape()
            if first is not None:
                first.t = 0.0
            t0 = time.perf_counter()
            poller.t0 = t0
            poller.start()
        results: list[RequestResult] = []
        try:
            if closed_loop:
                results = await _closed(session, cfg, requests, closed_loop, duration_s or math.inf, t0, max_requests)
            else:
                results = await _open(session, cfg, requests, plan, t0)
        finally:
            end = time.perf_counter()
            if cfg.timeline_interval_s and cfg.timeline_interval_s > 0:
                await poller.stop()
            await poll_session.close()
    return RunOutput(results, end - t0, poller.samples, poller.errors, warm_errors)


async def _open(session, cfg: ClientConfig, requests: list[BenchRequest], plan: ArrivalPlan, t0: float):
    times = plan.times
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = _progress(len(times), cfg.progress, "requests")
    out = [RequestResult(i, scheduled_s=float(times[i]), phase=plan.phases[i] if plan.phases else None)
           for i in range(len(times))]

    async def one(i: int) -> None:
        try:
            if sem is None:
                await send_request(session, cfg, requests[i % len(requests)], out[i], t0)
            else:
                async with sem:
                    await send_request(session, cfg, requests[i % len(requests)], out[i], t0)
        finally:
            if bar is not None:
                bar.update(1)

    tasks = []
    try:
        for i in range(len(times)):
            delay = t0 + float(times[i]) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        if bar is not None:
            bar.close()
    return out


async def _closed(session, cfg: ClientConfig, requests: list[BenchRequest], n_clients: int, duration_s: float,
                  t0: float, max_requests: int | None = None):
    out: list[RequestResult] = []
    bar = _progress(None, cfg.progress, f"closed loop x{n_clients}")
    next_i = 0

    async def client() -> None:
        nonlocal next_i
        while time.perf_counter() - t0 < duration_s and (max_requests is None or next_i < max_requests):
            i = next_i
            next_i += 1
            r = RequestResult(i, scheduled_s=time.perf_counter() - t0)
            out.append(r)
            await send_request(session, cfg, requests[i % len(requests)], r, t0)
            if bar is not None:
                bar.update(1)

    try:
        await asyncio.gather(*(client() for _ in range(n_clients)))
    finally:
        if bar is not None:
            bar.close()
    out.sort(key=lambda r: r.index)
    return out
