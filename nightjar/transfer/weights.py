"""Asynchronous draft weight (and draft KV) moves between device and host memory.

Every move runs on one worker thread. On CUDA the copies are issued on a side stream that first waits
for the work already queued on the device (a step still writing the draft's KV), and the worker waits
for that stream (not the loop); on CPU the worker copies into a host store. Either way the
caller's event loop is told by ``loop.call_soon_threadsafe(done, result)``; nothing here blocks it.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from nightjar.models.cpu_linear import drop_packed, refresh_packed
from nightjar.models.cuda_graph import weights_moved
from nightjar.transfer.weight_pack import pack_tensors, unpack_tensors

Failed = Callable[[str, BaseException, float], None]


@dataclass
class HostCopy:
    """The draft while it lives in host memory: packed weights and the draft KV segments."""
    buffer: torch.Tensor
    layout: tuple
    kv: list[torch.Tensor]
    nbytes: int


def unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())          # parameters() already skips tied duplicates


class DraftTransfer:
    def __init__(self, loop, failed: Failed | None = None, device=None) -> None:
        """``failed(kind, error, seconds)`` runs on the loop when a copy raises ("offload" or "reload");
        without it the error goes to the loop's exception handler. Either way it is never lost.
        With CUDA the copies run on a worker thread and a side stream. On CPU each copy runs on a thread
        that exits when it is done: a live thread that once ran torch's parallel CPU work would slow every
        later forward of the compute thread ~2x (kernel/threads.py). ``device``: the draft's (default: CUDA
        when there is one), so that a CPU engine on a machine with a GPU copies as on CPU."""
        self.loop, self.failed = loop, failed
        self.cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="nightjar-transfer") if self.cuda else None
        self.threads: list[threading.Thread] = []

    def offload(self, slot, done: Callable[[HostCopy, float], None]) -> None:
        """Copy the draft's weights and KV to host; ``done(host, seconds)`` runs on the loop."""
        self._submit("offload", self._offload, (slot,), done)

    def reload(self, slot, host: HostCopy, done: Callable[[int, float], None]) -> None:
        self._submit("reload", self._reload, (slot, host), done)

    def _submit(self, kind: str, fn, args, done) -> None:
        if self.pool is not None:
            self.pool.submit(self._run, kind, fn, args, done)
            return
        self.threads = [t for t in self.threads if t.is_alive()]
        t = threading.Thread(target=self._run, args=(kind, fn, args, done), name=f"nightjar-transfer-{kind}",
                             daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, kind: str, fn, args, done) -> None:
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:               # the worker's future is never read: report it here
            if self.failed is not None:
                self.loop.call_soon_threadsafe(self.failed, kind, e, time.perf_counter() - t0)
            else:
                self.loop.call_soon_threadsafe(self.loop.call_exception_handler,
                                               {"message": f"draft {kind} failed", "exception": e})
            return
        self.loop.call_soon_threadsafe(done, result, time.perf_counter() - t0)

    def _offload(self, slot) -> HostCopy:
        params = unique_params(slot.model)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(slot.device))   # after queued draft work
            with torch.cuda.stream(self.stream):
                buf, layout = pack_tensors([p.data for p in params])
                kv = [seg.data.to("cpu", non_blocking=True) for seg in slot.cache.segments]
                torch.cuda.current_stream().synchronize()
        else:
            buf, layout = pack_tensors([p.data for p in params])
            kv = slot.cache.to_host()
        return HostCopy(buf, layout, kv, buf.numel() + sum(t.numel() * t.element_size() for t in kv))

    def _reload(self, slot, host: HostCopy) -> int:
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(slot.device))   # after queued draft work
            with torch.cuda.stream(self.stream):
                tensors = unpack_tensors(host.buffer, host.layout, slot.device)
                slot.cache.restore(host.kv)
                torch.cuda.current_stream().synchronize()
        else:
            tensors = unpack_tensors(host.buffer, host.layout, slot.device)
            slot.cache.restore(host.kv)
        for p, t in zip(unique_params(slot.model), tensors):
            p.data = t
        refresh_packed(slot.model)           # oneDNN-packed copies of the moved CPU weights
        weights_moved(slot.model)            # its CUDA graphs point at the old addresses
        return host.nbytes

    def shutdown(self) -> None:
        """Wait for the copies in flight."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for t in self.threads:
            t.join()


def release_draft(slot) -> int:
    """Drop the draft's device tensors (weights and KV); returns the bytes released."""
    freed = 0
    for p in unique_params(slot.model):
        freed += p.data.numel() * p.data.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    freed += drop_packed(slot.model)
    weights_moved(slot.model)                # drops its CUDA graphs now: their memory goes to the KV pool
    return freed + slot.cache.release()
