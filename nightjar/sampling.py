"""Public sampling parameters and request outputs of the embedded API."""
from __future__ import annotations

from dataclasses import dataclass, field

from nightjar.kernel.messages import SamplingSpec


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def to_spec(self) -> SamplingSpec:
        return SamplingSpec(max_tokens=int(self.max_tokens), temperature=float(self.temperature),
                            top_p=float(self.top_p), top_k=int(self.top_k), seed=self.seed,
                            stop_token_ids=tuple(int(t) for t in self.stop_token_ids),
                            ignore_eos=bool(self.ignore_eos), min_tokens=int(self.min_tokens))


@dataclass
class RequestOutput:
    request_id: int
    text_delta: str
    token_ids: list[int]              # new tokens in this delta
    text: str                         # all text so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(RuntimeError):
    """The engine stopped (an actor failed or the engine was shut down)."""


class RequestError(ValueError):
    """One request was refused (bad input or backpressure); ``status`` is HTTP-like."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ConfigError(ValueError):
    """An engine setting is invalid; ``field`` is the EngineConfig field (the CLI flag ``--field-name``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")
