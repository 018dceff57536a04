"""Per-request delta-merging collector between the engine stream and an HTTP client.

A pump task drains ``engine.generate()`` into one pending, merged delta; the writer takes whatever
has accumulated each time it is ready. A slow client therefore gets fewer, larger SSE chunks instead
of a growing backlog (vllm/v1/engine/output_processor.py). Closing the collector cancels the pump,
which closes the engine iterator: the engine aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from nightjar.sampling import RequestOutput


class DeltaCollector:
    def __init__(self, outputs: AsyncIterator[RequestOutput], first: RequestOutput):
        self._outputs = outputs
        self._pending: RequestOutput | None = first
        self._error: BaseException | None = None
        self._done = first.finished
        self._ready = asyncio.Event()
        self._task = None if self._done else asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for out in self._outputs:
                self._merge(out)
                self._ready.set()
        except Exception as e:  # surfaced to the writer after the deltas that preceded it
            self._error = e
        finally:
            self._done = True
            self._ready.set()

    def _merge(self, out: RequestOutput) -> None:
        p = self._pending
        if p is None:
            self._pending = out
            return
        p.text_delta += out.text_delta
        p.token_ids.extend(out.token_ids)
        p.text, p.finish_reason = out.text, out.finish_reason
        p.num_prompt_tokens, p.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens

    async def next(self) -> RequestOutput | None:
        """The merged delta since the last call; None once the stream has ended."""
        while self._pending is None:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._done:
                return None
            self._ready.clear()
            await self._ready.wait()
        out, self._pending = self._pending, None
        return out

    async def aclose(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        aclose = getattr(self._outputs, "aclose", None)
        if aclose is not None:
            await aclose()
