"""Nightjar: an LLM serving engine with adaptive speculative decoding and elastic draft memory."""
__version__ = "0.1.0"
