"""OpenAI-compatible HTTP server (aiohttp) and Prometheus metrics for the Nightjar engine."""
from nightjar.api.app import create_app, serve, start_guarded
from nightjar.api.connections import ServerLimits

__all__ = ["ServerLimits", "create_app", "serve", "start_guarded"]
