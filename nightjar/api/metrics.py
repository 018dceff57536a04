"""Prometheus metrics: a private registry per app, fed by a bus tap (engine facts) and the HTTP layer
(client-visible latencies). Names follow vLLM's ``vllm:*`` schema under the ``nightjar:`` prefix;
prometheus-client appends ``_total`` to counters.

The tap runs synchronously inside ``Bus.publish`` on the actors' hot path, so it is one dict lookup
per message, and it never raises (an exception there would crash the publishing actor).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nightjar.actors.gamma_allocator import gamma_histogram
from nightjar.kernel.messages import (
    DraftOffloaded,
    DraftReloaded,
    DraftResidency,
    PoolResized,
    StepTimed,
    TokensCommitted,
)

log = logging.getLogger("nightjar.api")

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """All metrics of one app. ``tap`` goes on ``engine.bus``; ``observe_request`` is called per request."""

    def __init__(self, gamma_max: int = 8) -> None:
        r = self.registry = CollectorRegistry()
        p = "nightjar:"
        # speculative decoding (vLLM's spec_decode schema), from StepTimed
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Draft rounds (one per speculating row per step).",
                                  registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by draft position (0-based).", ["position"], registry=r)
        for i in range(gamma_max):
            self.accepted_per_pos.labels(position=str(i))
        self.spec_gamma = Histogram(p + "spec_gamma", "Draft length γ chosen per decode step (max γ_i per-request).",
                                    buckets=tuple(range(0, 9)), registry=r)
        self.spec_row_gamma = Counter(p + "spec_row_gamma", "Decode rows by the draft length γ_i they drafted "
                                      "(per-request planner; batch-level: γ, 0 for rows that do not draft).",
                                      ["gamma"], registry=r)
        for i in range(gamma_max + 1):
            self.spec_row_gamma.labels(gamma=str(i))
        self.generation_tokens = Counter(p + "generation_tokens", "Output tokens committed.", registry=r)
        # HTTP layer
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to first output.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1) per request.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request arrival to last output.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests, by finish reason.",
                                       ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(finish_reason=reason)
        self.rejected = Counter(p + "requests_rejected", "Requests refused by the engine, by HTTP status.",
                                ["status"], registry=r)
        # scheduler and KV pool (refreshed on scrape)
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV pool size in blocks.", registry=r)
        self.kv_free = Gauge(p + "kv_blocks_free", "Free KV blocks.", registry=r)
        # elastic draft memory
        self.draft_resident = Gauge(p + "draft_resident", "1 when the draft model is on the device.", registry=r)
        self.offloads = Counter(p + "draft_offloads", "Draft offloads completed.", registry=r)
        self.reloads = Counter(p + "draft_reloads", "Draft reloads completed.", registry=r)
        self.offload_s = Histogram(p + "draft_offload_seconds", "Draft offload duration.",
                                   buckets=_TRANSFER_BUCKETS, registry=r)
        self.reload_s = Histogram(p + "draft_reload_seconds", "Draft reload duration.",
                                  buckets=_TRANSFER_BUCKETS, registry=r)
        self.pool_resizes = Counter(p + "kv_pool_resizes", "KV pool resizes.", registry=r)
        self.blocks_migrated = Counter(p + "kv_blocks_migrated", "KV blocks migrated by pool resizes.", registry=r)
        self._handlers: dict[type, Callable[[Any], None]] = {
            StepTimed: self._on_step, TokensCommitted: self._on_commit, DraftOffloaded: self._on_offloaded,
            DraftReloaded: self._on_reloaded, DraftResidency: self._on_residency, PoolResized: self._on_resized,
        }
        self._engine = None
        self._tap_failed = False

    # ---- engine side (bus tap) -------------------------------------------------------------------
    def attach(self, engine) -> None:
        self._engine = engine
        engine.bus.add_tap(self.tap)
        weights = getattr(engine, "weights", None)       # DraftResidency may have been published already
        if weights is not None:
            self.draft_resident.set(1 if getattr(weights, "state", "") == "RESIDENT" else 0)
        self.refresh()

    def detach(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.bus.remove_tap(self.tap)
            except ValueError:
                pass

    def tap(self, env) -> None:
        handler = self._handlers.get(type(env.msg))
        if handler is None:
            return
        try:
            handler(env.msg)
        except Exception:  # never let a metrics bug crash an actor
            if not self._tap_failed:
                self._tap_failed = True
                log.exception("metrics tap failed on %s (further failures are silent)", type(env.msg).__name__)

    def _on_step(self, m: StepTimed) -> None:
        if m.batch_size > 0:
            self.spec_gamma.observe(m.gamma)
            for g, n in enumerate(gamma_histogram(m.batch_size, m.gamma, m.num_drafts, m.drafted_per_pos)):
                if n:
                    self.spec_row_gamma.labels(gamma=str(g)).inc(n)
        if not m.gamma or not m.num_drafts:
            return
        self.num_drafts.inc(m.num_drafts)
        self.num_draft_tokens.inc(sum(m.drafted_per_pos) if m.drafted_per_pos else m.num_drafts * m.gamma)
        self.num_accepted.inc(sum(m.accepted_per_pos))
        for i, a in enumerate(m.accepted_per_pos):
            if a:
                self.accepted_per_pos.labels(position=str(i)).inc(a)

    def _on_commit(self, m: TokensCommitted) -> None:
        n = sum(m.counts)
        if n:
            self.generation_tokens.inc(n)

    def _on_offloaded(self, m: DraftOffloaded) -> None:
        self.offloads.inc()
        self.offload_s.observe(m.duration_s)
        self.draft_resident.set(0)

    def _on_reloaded(self, m: DraftReloaded) -> None:
        self.reloads.inc()
        self.reload_s.observe(m.duration_s)
        self.draft_resident.set(1)

    def _on_residency(self, m: DraftResidency) -> None:
        self.draft_resident.set(1 if m.resident else 0)

    def _on_resized(self, m: PoolResized) -> None:
        self.pool_resizes.inc()
        if m.migrated:
            self.blocks_migrated.inc(m.migrated)
        self.kv_total.set(m.num_total)

    # ---- HTTP side ---------------------------------------------------------------------------------
    def observe_request(self, ttft: float | None, e2e: float, num_prompt: int, num_output: int,
                        finish_reason: str | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(num_prompt)
        if finish_reason:
            self.request_success.labels(finish_reason=finish_reason).inc()

    def observe_rejection(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def refresh(self) -> None:
        """Scheduler and pool gauges, read from the engine at scrape time."""
        e = self._engine
        if e is None or not getattr(e, "started", False):
            return
        batcher, alloc = getattr(e, "batcher", None), getattr(e, "allocator", None)
        if batcher is not None:
            self.running.set(batcher.num_running)
            self.waiting.set(batcher.num_waiting)
        if alloc is not None:
            self.kv_total.set(alloc.num_total)
            self.kv_free.set(alloc.num_free)

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)
