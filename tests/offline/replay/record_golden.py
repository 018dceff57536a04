"""Re-record the golden traces (run after an intended control-plane change, then review the diff of
``nightjar replay`` output):  .venv/bin/python tests/offline/replay/record_golden.py

Tiny random fp32 models with SmolLM2's tokenizer; a small pool so that preemption happens; greedy,
sampled and seeded requests and one client abort under off, fixed:2 and nightjar (with a forced draft
offload/reload cycle). tests/offline/test_replay.py replays every one of them and fails if none is here."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from nightjar.engine import Engine  # noqa: E402
from nightjar.models import LoadedModel  # noqa: E402
from nightjar.sampling import SamplingParams  # noqa: E402
from tests.conftest import perturbed, random_model, tiny_config  # noqa: E402

HERE = Path(__file__).parent


def tiny_pair():
    from gguf import GGUFReader

    from nightjar.models import hub
    from nightjar.models.tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(GGUFReader(str(hub.pull("smollm2-135m", quiet=True))))
    target = random_model(tiny_config(eos=tok.eos_token_ids), seed=1)
    return LoadedModel(target, tok, "tiny"), LoadedModel(perturbed(target, 0.3, 2), None, "tiny-draft")


async def record(pair, policy: str, path: Path, n: int = 6, cycle: bool = False) -> None:
    """n staggered requests (greedy, sampled, seeded), one aborted by its client; with ``cycle`` a forced
    draft offload/reload in the middle of the run."""
    from nightjar.kernel.messages import OffloadDraft, ReloadDraft

    async with Engine(policy=policy, loaded=pair, dtype="float32", trace=str(path), num_blocks=24, block_size=8,
                      max_num_seqs=4, gamma_max=3) as eng:
        async def one(i):
            await asyncio.sleep(0.003 * i)
            sp = SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                                seed=i if i % 3 == 0 else None)
            toks = []
            async for o in eng.generate(list(range(200 + i, 216 + 4 * i)), sp):
                toks += o.token_ids
                if i == 2 and len(toks) >= 3:
                    break                                       # the client goes away: an abort
            return toks

        async def offload_cycle():
            while eng.stats.steps < 6:
                await asyncio.sleep(0.002)
            eng.bus.publish("golden", [OffloadDraft(reason="golden")])
            while eng.weights.state != "OFFLOADED":
                await asyncio.sleep(0.002)
            start = eng.stats.steps
            while eng.stats.steps < start + 4:
                await asyncio.sleep(0.002)
            eng.bus.publish("golden", [ReloadDraft(reason="golden")])
        await asyncio.gather(*[one(i) for i in range(n)], *([offload_cycle()] if cycle else []))


RUNS = [("off", False), ("fixed:2", False), ("nightjar", True)]     # (policy, forced offload/reload cycle)


def main() -> None:
    for policy, cycle in RUNS:
        pair = tiny_pair()          # fresh: an engine stopped while the draft is offloaded leaves it released
        path = HERE / f"tiny_{policy.replace(':', '')}.njtrace"
        asyncio.run(record(pair, policy, path, cycle=cycle))
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
