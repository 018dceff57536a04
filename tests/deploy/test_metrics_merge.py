"""Merging replicas' Prometheus expositions: one HELP/TYPE per family, every sample labelled by replica."""
from __future__ import annotations

from nightjar.api.metrics import ServerMetrics
from nightjar.bench.metrics import parse_prometheus
from nightjar.deploy.metrics_merge import merge_replica_metrics

A = """# HELP x_total Things.
# TYPE x_total counter
x_total 3.0
# HELP y Labelled.
# TYPE y gauge
y{reason="stop"} 1.0
y{reason="length"} 2.0
"""
B = """# HELP x_total Things.
# TYPE x_total counter
x_total 4.0
# HELP y Labelled.
# TYPE y gauge
y{reason="stop"} 5.0
"""


def test_families_stay_contiguous_with_one_help_and_type_each():
    out = merge_replica_metrics({"b": B, "a": A}).splitlines()
    assert out == ["# HELP x_total Things.", "# TYPE x_total counter", 'x_total{replica="a"} 3.0',
                   'x_total{replica="b"} 4.0', "# HELP y Labelled.", "# TYPE y gauge",
                   'y{replica="a",reason="stop"} 1.0', 'y{replica="a",reason="length"} 2.0',
                   'y{replica="b",reason="stop"} 5.0']


def test_the_servers_real_exposition_merges_into_parseable_labelled_samples():
    text = ServerMetrics(4).render().decode()
    merged = merge_replica_metrics({"r1": text, "r2": text})
    flat = parse_prometheus(merged)
    plain = parse_prometheus(text)
    assert len(flat) == 2 * len(plain) and all('replica="' in k for k in flat)
    assert merged.count("# TYPE nightjar:num_requests_running gauge") == 1
    assert merge_replica_metrics({}) == ""

