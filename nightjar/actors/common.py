"""Helpers shared by the model actors (draft executor, verifier): request mirrors and forwards."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nightjar.actors.sampler import gumbel_noise, seeded_scores
from nightjar.kernel.messages import BlocksReserved, RequestAdmitted, SamplingSpec, TokensCommitted
from nightjar.kernel.seeds import derive_seed, request_seed
from nightjar.models.cuda_graph import graph_forward
from nightjar.models.llama import build_layout


def drafter_stays_quiet(msg) -> bool:
    """A drafter's bookkeeping waits in its mailbox (kernel/actor.py, quiet messages) for the next step it drafts
    in; a finished request wakes it, so that its draft state is freed when the engine goes idle."""
    if isinstance(msg, BlocksReserved):
        return msg.gamma == 0
    if isinstance(msg, TokensCommitted):
        return not any(msg.finish)
    return True


@dataclass
class ReqMirror:
    """What a model actor keeps of one request: tokens so far (prompt, then output), sampling params,
    its generator."""
    tokens: list[int]
    sampling: SamplingSpec
    gen: torch.Generator | None = None
    prompt_len: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature <= 0

    @property
    def seeded(self) -> bool:
        """A user-seeded sampling request: sampled by Gumbel-max with per-position noise."""
        return not self.greedy and self.sampling.seed is not None

    def noise_seeds(self, first: int, n: int) -> list[int]:
        """Seeds of the noise of output positions first .. first+n-1 (from the user seed alone)."""
        return [derive_seed(self.sampling.seed, "gumbel", t) for t in range(first, first + n)]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len


class RequestMirrors:
    """Per-request state rebuilt from RequestAdmitted (whole, once) and TokensCommitted (deltas)."""

    def __init__(self, root_seed: int, stream: str, device: torch.device | str = "cpu"):
        self.root_seed, self.stream, self.device = root_seed, stream, device
        self.reqs: dict[int, ReqMirror] = {}

    def admit(self, msg: RequestAdmitted) -> None:
        sp = msg.sampling
        gen = None
        if sp.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request_seed(self.root_seed, msg.req_id, sp.seed, self.stream))
        self.reqs[msg.req_id] = ReqMirror(list(msg.prompt_ids), sp, gen, prompt_len=len(msg.prompt_ids))

    def commit(self, msg: TokensCommitted) -> list[int]:
        """Extend token lists; returns the ids that finished (and were dropped)."""
        pos, done = 0, []
        for rid, n, fin in zip(msg.req_ids, msg.counts, msg.finish):
            if rid in self.reqs:
                self.reqs[rid].tokens.extend(msg.tokens[pos: pos + n])
            pos += n
            if fin:
                self.reqs.pop(rid, None)
                done.append(rid)
        return done

    def observe(self, msg) -> list[int] | None:
        """Keep the mirrors current. Returns the finished ids for a TokensCommitted, [] for a
        RequestAdmitted, None for any other message (the actor's own to handle)."""
        if isinstance(msg, RequestAdmitted):
            self.admit(msg)
            return []
        if isinstance(msg, TokensCommitted):
            return self.commit(msg)
        return None

    def __getitem__(self, rid: int) -> ReqMirror:
        return self.reqs[rid]


def run_chunks(model, cache, block_size: int, chunks: list[list[int]], starts: list[int],
               tables: list[tuple[int, ...]], logits_rows: list[int], capture: tuple[int, ...] = ()):
    """One batched forward of varlen chunks; logits [sum(logits_rows), V] fp32. A CUDA graph replays it
    when the model has a runner for this cache and shape (models/cuda_graph.py), else it runs eagerly.
    With ``capture`` (eager only) returns (logits, features [T, nF*H]) as ``LlamaModel.forward``."""
    if not capture:
        logits = graph_forward(model, cache, chunks, starts, tables, logits_rows)
        if logits is not None:
            return logits
    lay = build_layout(chunks, starts, tables, block_size, logits_rows, device=model.device)
    return model(lay, cache, capture) if capture else model(lay, cache)


def seeded_scores_of(mirror: ReqMirror, probs: torch.Tensor, first: int) -> torch.Tensor:
    """Gumbel-max scores [n, V] of a seeded request at output positions first.. from probs [n, V]:
    the argmax of row i is the request's seeded sample at position first + i."""
    noise = gumbel_noise(mirror.noise_seeds(first, probs.shape[0]), probs.shape[-1], probs.device)
    return seeded_scores(probs, noise)


def sampling_tensors(specs: list[SamplingSpec], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temp = torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device)
    top_k = torch.tensor([s.top_k for s in specs], dtype=torch.int64, device=device)
    top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device)
    return temp, top_k, top_p
