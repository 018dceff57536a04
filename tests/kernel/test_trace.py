"""Trace files: round trip, rotation, and clear TraceErrors (never a wrong answer) for damaged files."""
from __future__ import annotations

import pytest

from nightjar.kernel.bus import Envelope
from nightjar.kernel.messages import SamplingSpec, StepPlanned, StepScheduled, SubmitRequest
from nightjar.kernel.trace import SCHEMA_VERSION, TraceError, TraceReader, TraceWriter, part_path, read_trace


def envelopes(n=12):
    out = []
    for i in range(1, n + 1):
        if i % 3 == 0:
            m = SubmitRequest(req_id=i, prompt_ids=(1, 2, i), sampling=SamplingSpec(max_tokens=i, seed=i))
        elif i % 3 == 1:
            m = StepScheduled(step=i, req_ids=(1, 2), starts=(3, 4), chunk_ids=((5,), (6,)), num_decode=2,
                              draft_computed=(1, 2), speculate=(True, False), prefill_done=())
        else:
            m = StepPlanned(step=i, gamma=i % 4)
        out.append(Envelope(i, 0.25 * i, "test", m))
    return out


def record(path, envs, **kw):
    with TraceWriter(path, {"config": {"seed": 7}, "vocab_size": 10}, **kw) as w:
        for e in envs:
            w.write(e)
    return path


def test_a_trace_round_trips_header_and_envelopes(tmp_path):
    envs = envelopes()
    head, got, foot = read_trace(record(tmp_path / "t.njtrace", envs))
    assert got == envs
    assert head["schema_version"] == SCHEMA_VERSION and head["seed"] == 7 and head["vocab_size"] == 10
    assert foot["last_seq"] == 12 and foot["num_envelopes"] == 12


def test_rotation_rolls_into_self_contained_parts_that_read_as_one_trace(tmp_path):
    envs = envelopes(40)
    p = record(tmp_path / "t.njtrace", envs, max_bytes=600)
    assert part_path(p, 2).exists()
    assert TraceReader(part_path(p, 1)).header["part"] == 1        # each part has its own header
    assert list(TraceReader(p)) == envs
    part_path(p, 2).unlink()
    with pytest.raises(TraceError, match="missing trace part"):
        list(TraceReader(p))


def test_every_single_flipped_byte_gives_a_trace_error(tmp_path):
    p = record(tmp_path / "t.njtrace", envelopes(5))
    data = p.read_bytes()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x41
        p.write_bytes(bytes(bad))
        with pytest.raises(TraceError):
            list(TraceReader(p, allow_schema_drift=True))


def test_a_truncated_file_is_reported_even_at_a_frame_boundary(tmp_path):
    p = record(tmp_path / "t.njtrace", envelopes(6))
    data = p.read_bytes()
    for cut in range(8, len(data) - 1, 7):
        p.write_bytes(data[:cut])
        with pytest.raises(TraceError, match="truncated|missing header"):
            list(TraceReader(p))
    p.write_bytes(data[:-20])              # the footer is gone: the prefix is readable on request
    r = TraceReader(p, allow_truncated=True)
    assert list(r) == envelopes(6) and r.truncated


def test_bad_magic_newer_schema_version_and_other_schema_hash_are_refused(tmp_path):
    p = tmp_path / "t.njtrace"
    p.write_bytes(b"GARBAGE!" + bytes(20))
    with pytest.raises(TraceError, match="bad magic"):
        TraceReader(p)
    with TraceWriter(p, {"schema_version": SCHEMA_VERSION + 1}):
        pass
    with pytest.raises(TraceError, match="newer"):
        TraceReader(p)
    with TraceWriter(p, {"schema_hash": "0123456789abcdef"}) as w:
        w.write(envelopes(1)[0])
    with pytest.raises(TraceError, match="schema differs"):
        TraceReader(p)
    assert list(TraceReader(p, allow_schema_drift=True)) == envelopes(1)


def test_writing_costs_a_few_microseconds_per_envelope(tmp_path):
    import time
    envs = envelopes(3000)
    w = TraceWriter(tmp_path / "t.njtrace", {})
    t0 = time.perf_counter()
    for e in envs:
        w.write(e)
    dt = (time.perf_counter() - t0) / len(envs)
    w.close()
    assert dt < 50e-6, dt          # ~1-3 µs measured; generous for a shared CPU
