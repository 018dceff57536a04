"""Nightjar's serving benchmark harness: ``nightjar bench serve`` and ``nightjar bench compare``.

Modules:

* ``arrivals`` -- Poisson / gamma arrival times, phased traces (``--trace FILE``), closed-loop clients.
* ``datasets`` -- prompt sets built from :func:`nightjar.data.load_prompts` with ShareGPT/Alpaca/SpecBench-shaped
  lengths, ``random`` token-count prompts and ``custom`` JSONL files.
* ``client`` -- the async aiohttp load generator (streaming chat or completions) and the ``/metrics`` poller.
* ``metrics`` -- vLLM's client-side definitions: TTFT, TPOT, ITL, E2E, throughput, goodput, timeline.
* ``report`` -- JSON result, markdown table and PNG plots.
* ``server`` -- a fresh ``nightjar serve`` subprocess, or an in-process server on a loopback port.
* ``compare`` -- several policies on the same arrivals, interleaved repetitions, ratios.
* ``cli`` -- ``main(argv)``, called by ``nightjar bench ...``.

See ``docs/bench_harness.md``.
"""
from __future__ import annotations

__all__ = ["arrivals", "client", "compare", "datasets", "metrics", "report", "server"]
