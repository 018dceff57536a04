"""The shipped drafters: "default" names the draft head, "independent" the small draft model (whose logits
through our loader equal transformers', fp32); speculative decoding with either on the real SmolLM2 is
greedy-exact."""
from __future__ import annotations

import asyncio

import pytest
import torch

from nightjar.models import INDEPENDENT_DRAFT_DIR, cpu_fused, load_draft
from nightjar.models.loader import load_weights
from tests.models.test_llama_parity import Runner

transformers = pytest.importorskip("transformers")


def test_the_independent_draft_is_shipped_small_and_shares_the_vocabulary(smollm2_fp32):
    files = {p.name: p.stat().st_size for p in INDEPENDENT_DRAFT_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert files["model.safetensors"] <= 40 * 1024 * 1024
    draft = load_draft("independent", smollm2_fp32.config, "float32")
    assert draft.source != "random" and draft.config.vocab_size == smollm2_fp32.config.vocab_size == 49152


def test_our_loader_and_transformers_give_the_same_draft_logits():
    ours = load_weights(INDEPENDENT_DRAFT_DIR, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(INDEPENDENT_DRAFT_DIR, dtype=torch.float32).eval()
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 30, 2, 198, 1, 4093, 198, 1780, 314]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = Runner(ours, block_size=16).run({0: (ids, 0)}, {0: len(ids)})
    assert torch.allclose(got, ref, atol=1e-4)


def greedy_runs(pair, policy: str, prompts: list[str], max_tokens: int = 32):
    """Each prompt's greedy tokens through an fp32 engine on ``pair``, and the engine's stats."""
    from nightjar.engine import Engine
    from nightjar.sampling import SamplingParams

    async def run():
        async with Engine(policy=policy, loaded=pair, dtype="float32", gamma_max=4) as eng:
            async def one(p):
                return [t for o in [x async for x in eng.generate([{"role": "user", "content": p}],
                                                                   SamplingParams(max_tokens=max_tokens))]
                        for t in o.token_ids]
            return await asyncio.gather(*[one(p) for p in prompts]), eng.stats
    return asyncio.run(run())


def test_speculative_decoding_with_the_independent_draft_is_greedy_exact_on_smollm2(smollm2_fp32):
    draft = load_draft("independent", smollm2_fp32.config, "float32")
    prompts = ["What is the capital of Italy?", "Write a short poem about rain.", "Explain photosynthesis briefly."]
    ref, _ = greedy_runs((smollm2_fp32, draft), "off", prompts)
    got, stats = greedy_runs((smollm2_fp32, draft), "fixed:4", prompts)
    assert got == ref
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens       # a trained draft, not a random one


def test_the_default_draft_is_the_shipped_head_and_drafts_greedy_exact_on_smollm2(smollm2_fp32):
    from nightjar.models import HEAD_DRAFT_DIR
    from nightjar.models.eagle import is_head

    assert (HEAD_DRAFT_DIR / "head.safetensors").stat().st_size <= 40 * 1024 * 1024
    assert (HEAD_DRAFT_DIR / "README.md").exists()                          # its model card
    head = load_draft("default", smollm2_fp32.config, "float32")
    assert head.source == str(HEAD_DRAFT_DIR.resolve()) == load_draft("head", smollm2_fp32.config).source
    assert is_head(head.model) and head.model.hc.draft_vocab == 8192
    assert head.model.self_attn.cpu_fused == cpu_fused.available()      # served on the fused CPU ops
    prompts = ["What is the capital of Italy?", "Write a short poem about rain.", "List three primary colours."]
    ref, _ = greedy_runs((smollm2_fp32, head), "off", prompts)
    got, stats = greedy_runs((smollm2_fp32, head), "fixed:3", prompts)
    assert got == ref
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens       # a trained head, fed the right features


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_draft_head_drafts_greedy_exact_and_still_gets_accepted(smollm2_fp32, mode):
    """--draft-quantization reaches a draft head too: every linear layer a QuantLinear, its LM head over the
    draft vocabulary an int8 QuantHead (where the fused ops build); verification stays exact."""
    from nightjar.models.eagle import is_head
    from nightjar.models.quant import QuantHead, load_quantized, quantized_modes

    head = load_quantized("default", "float32", "cpu", mode, draft_for=smollm2_fp32.config)
    assert is_head(head.model) and quantized_modes(head.model) == {mode}
    assert isinstance(head.model.lm_head, QuantHead) == cpu_fused.available()
    assert not any(type(m) is torch.nn.Linear for m in head.model.modules())
    prompts = ["What is the capital of Italy?", "Write a short poem about rain."]
    ref, _ = greedy_runs((smollm2_fp32, None), "off", prompts)
    got, stats = greedy_runs((smollm2_fp32, head), "fixed:3", prompts)
    assert got == ref
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens
    small = load_quantized("independent", "float32", "cpu", mode, draft_for=smollm2_fp32.config)
    assert quantized_modes(small.model) == {mode}


def test_a_shipped_name_whose_files_are_missing_falls_back_to_a_logged_random_draft(monkeypatch, tmp_path, caplog,
                                                                                     smollm2_fp32):
    import nightjar.models as m

    monkeypatch.setitem(m.NAMED_DRAFTS, "default", tmp_path / "gone")
    with caplog.at_level("WARNING", logger="nightjar.models"):
        draft = load_draft("default", smollm2_fp32.config, "float32")
    assert draft.source == "random" and "RANDOMLY INITIALISED" in caplog.text


def test_a_shipped_drafter_for_another_target_is_refused_with_a_hint():
    from tests.conftest import tiny_config

    for name in ("default", "independent"):
        with pytest.raises(ValueError, match="made for SmolLM2-135M-Instruct: use a draft made for this model"):
            load_draft(name, tiny_config(vocab=1000), "float32")
