"""Nightjar replicas on Ray Serve: one ``nightjar.Engine`` per replica behind one OpenAI-compatible endpoint.

Needs the optional extra (``pip install -e '.[ray]'``). Nothing outside this package imports Ray.
"""
from nightjar.deploy.metrics_merge import merge_replica_metrics

__all__ = ["merge_replica_metrics"]
