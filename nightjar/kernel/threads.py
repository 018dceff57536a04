"""Which OS thread runs torch's parallel CPU work.

torch's CPU build parallelises with libgomp (OpenMP). libgomp keeps a team of worker threads for every OS
thread that has run a parallel region, until that thread exits. Once the teams together hold more threads
than there are CPUs, libgomp *throttles*: a worker spins ~100 times instead of ~300,000 before it sleeps,
so every parallel region pays a futex wake-up. A forward runs ~1,500 of them. Measured on the 2-core
box (SmolLM2-135M, bf16, B = 1, one forward): 29 ms while one thread had ever run parallel work, 55–66 ms
from the moment a second thread had run one large op (a model load, a 64 MB fill), for as long as that
thread lived, on both threads.

So the engine loads its models, allocates its caches and runs every forward on its one compute thread (with
``EngineConfig.inline_compute``, the event loop's own thread: no hand-off per step, no I/O while a forward runs);
torch work that must happen elsewhere (the KV pool's grow and shrink, which run on the event loop; CPU
draft-weight copies, which overlap steps) runs on a short-lived thread, whose team goes away when it exits.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


def on_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a new thread that exits when it returns; blocks the caller until then and returns
    its result or raises its exception."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:          # re-raised on the caller's thread
            err.append(e)

    t = threading.Thread(target=run, name="nightjar-oneshot", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
