"""OpenAI-compatible HTTP server (aiohttp) and Prometheus metrics for the Nightjar engine."""
from nightjar.api.app import create_app, serve

__all__ = ["create_app", "serve"]
