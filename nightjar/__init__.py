"""Nightjar: an LLM serving engine with adaptive speculative decoding and elastic draft memory."""
from nightjar.sampling import EngineError, RequestError, RequestOutput, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Engine", "generate"):
        from nightjar import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["Engine", "EngineError", "RequestError", "RequestOutput", "SamplingParams", "generate"]
