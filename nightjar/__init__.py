"""Nightjar: an LLM serving engine with adaptive speculative decoding and elastic draft memory."""
import os
import sys

# How long an idle OpenMP worker of torch (libgomp) spins before it sleeps. libgomp's default (300,000) keeps torch's
# second thread spinning through the event loop's work between two forwards, so on a 2-core machine the loop's
# wake-up waits for a core: ~290 µs of a 10.5 ms B = 1 step against ~85 µs at 10,000, with forwards as fast
# (docs/benchmarks.md, forty-fifth session). libgomp reads it when torch loads, so only if torch is not loaded yet,
# and never over the user's own value.
GOMP_SPINCOUNT = "10000"
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)

from nightjar.sampling import EngineError, RequestError, RequestOutput, SamplingParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Engine", "generate"):
        from nightjar import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "EngineError", "RequestError", "RequestOutput", "SamplingParams", "generate"]
