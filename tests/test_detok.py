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


def test_pushes_give_the_text_of_one_decode_of_every_token_in_any_chunking(smol_tokenizer):
    """Decoding only the tokens since the last whole character gives what one decode of them all gives (less a
    trailing U+FFFD), for random ids (byte tokens, invalid UTF-8 in the middle, special tokens) in random chunks."""
    import random

    rng = random.Random(7)
    vocab = smol_tokenizer.tok.get_vocab_size()
    texts = ["Tokyo 東京 🌸 and Kyoto 京都 🍵 done", JAPANESE, "plain ascii, then 🌸🌸 emoji\n\n  spaced"]
    seqs = [smol_tokenizer.encode(t) for t in texts] + [[rng.randrange(vocab) for _ in range(60)] for _ in range(30)]
    for ids in seqs:
        text, k = IncrementalText(smol_tokenizer, []), 0
        while k < len(ids):
            n = rng.choice((1, 1, 1, 2, 3, 5))
            text.push(ids[k:k + n])
            k += n
            whole = smol_tokenizer.decode(ids[:k])
            assert text.text == (whole[:-1] if whole.endswith("\ufffd") else whole), (ids, k)


def test_a_decoder_that_strips_the_first_tokens_space_keeps_the_spaces_between_pushes():
    """SentencePiece-style (Metaspace) decoders drop the leading space of a decode's first token: each decode
    keeps tokens before the new ones as context, so no space goes missing between pushes."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁how": 3, "▁are": 4, "▁you": 5}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    sp.decoder = decoders.Metaspace()

    class Tok:
        def decode(self, ids):
            return sp.decode(list(ids))
    ids = [0, 1, 2, 3, 4, 5, 2]
    assert Tok().decode([1]) == "world"                  # the leading space goes at the start of a decode
    for chunk in (1, 2, 3):
        text = IncrementalText(Tok(), [])
        deltas = [text.push(ids[k:k + chunk]) for k in range(0, len(ids), chunk)]
        assert "".join(deltas) == text.text == "Hello world! how are you!"
