"""Tokenizer from GGUF metadata or ``tokenizer.json``, and HF-style chat template rendering (jinja2)."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pre_tokenizer(pre: str | None):
    """Split rule per llama.cpp's ``tokenizer.ggml.pre`` (``smollm`` splits digits one by one)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    steps = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"), byte_level]
    if pre in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def tokenizer_from_gguf_fields(tokens: list[str], merges: list[str], token_types: list[int],
                               pre: str | None) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` built from GGUF ``gpt2`` tokenizer metadata."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    alphabet = set(_byte_alphabet().values())
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, token_types) if ty == 3 and set(t) <= alphabet]
    tok.add_special_tokens(special)
    return tok


class ChatTokenizer:
    """Encode/decode plus the model's chat template, rendered the way HF ``apply_chat_template`` does."""

    def __init__(self, tok: Tokenizer, chat_template: str | None, bos: str | None, eos: str | None,
                 eos_ids: tuple[int, ...], add_bos: bool = False):
        self.tok, self.chat_template = tok, chat_template
        self.bos_token, self.eos_token, self.add_bos = bos, eos, add_bos
        self.eos_token_ids = eos_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def __getstate__(self) -> dict:
        """Picklable (e.g. shipped to a Ray Serve replica): the compiled template is rebuilt on first use."""
        return {**self.__dict__, "_template": None}

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            ids = [self.tok.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a raw prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))


def _compile_template(source: str):
    """Jinja2 environment as HF's chat templating sets it up (trim/lstrip blocks, sandboxed)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def tokenizer_from_gguf(reader) -> ChatTokenizer:
    f = lambda k, d=None: reader.fields[k].contents() if k in reader.fields else d  # noqa: E731
    if f("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {f('tokenizer.ggml.model')!r} not supported (byte-level BPE only)")
    tokens = f("tokenizer.ggml.tokens")
    tok = tokenizer_from_gguf_fields(tokens, f("tokenizer.ggml.merges"), f("tokenizer.ggml.token_type"),
                                     f("tokenizer.ggml.pre"))
    bos_id, eos_id = f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id")
    eos_ids = _chat_eos_ids(tok, eos_id)
    return ChatTokenizer(tok, f("tokenizer.chat_template"), tokens[bos_id] if bos_id is not None else None,
                         tokens[eos_id] if eos_id is not None else None, eos_ids,
                         add_bos=bool(f("tokenizer.ggml.add_bos_token", False)))


def _chat_eos_ids(tok: Tokenizer, eos_id: int | None) -> tuple[int, ...]:
    """EOS plus the chat end-of-turn marker when the vocabulary has one."""
    ids = [eos_id] if eos_id is not None else []
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        mid = tok.token_to_id(marker)
        if mid is not None and mid not in ids:
            ids.append(mid)
    return tuple(ids)


def tokenizer_from_dir(directory: str | Path) -> ChatTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` (chat template, bos/eos) of an HF checkpoint."""
    d = Path(directory)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    conf_path = d / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}
    template = conf.get("chat_template")
    if template is None and (d / "chat_template.jinja").exists():
        template = (d / "chat_template.jinja").read_text()
    name = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
    bos, eos = name(conf.get("bos_token")), name(conf.get("eos_token"))
    eos_id = tok.token_to_id(eos) if eos else None
    return ChatTokenizer(tok, template, bos, eos, _chat_eos_ids(tok, eos_id),
                         add_bos=bool(conf.get("add_bos_token", False)))
