"""Incremental detokenization with SmolLM2's real byte-level BPE tokenizer: an incomplete UTF-8 sequence
is held back while streaming and dropped when the output ends inside it."""
from __future__ import annotations

from nightjar.detok import IncrementalText

JAPANESE = "日本語の文章を書きます。東京は晴れです。"


def stream(tok, ids, stop=()):
    """Push ``ids`` one token at a time, the last one as final: (deltas, final text)."""
    text = IncrementalText(tok, list(stop))
    deltas = [text.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return deltas, text.text


def test_japanese_text_cut_inside_a_character_ends_without_a_replacement_character(smol_tokenizer):
    ids = smol_tokenizer.encode(JAPANESE)
    cuts = [k for k in range(1, len(ids) + 1) if smol_tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 5                     # byte-level BPE splits these characters across tokens
    for k in range(1, len(ids) + 1):
        deltas, text = stream(smol_tokenizer, ids[:k])
        whole = smol_tokenizer.decode(ids[:k])
        assert "".join(deltas) == text == (whole[:-1] if k in cuts else whole), k
        assert "\ufffd" not in text
    assert stream(smol_tokenizer, ids)[1] == JAPANESE


def test_streamed_deltas_never_show_a_partial_character_and_add_up_to_the_text(smol_tokenizer):
    ids = smol_tokenizer.encode("Tokyo 東京 🌸 and Kyoto 京都 🍵 done")
    deltas, text = stream(smol_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == "Tokyo 東京 🌸 and Kyoto 京都 🍵 done"


def test_a_stop_string_after_multibyte_text_still_cuts_the_answer(smol_tokenizer):
    ids = smol_tokenizer.encode(JAPANESE)
    deltas, text = stream(smol_tokenizer, ids, stop=["東京"])
    assert text == "日本語の文章を書きます。" and "".join(deltas) == text
