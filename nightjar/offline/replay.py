"""``nightjar replay FILE``: deterministic control-plane replay of a recorded trace (and ``--full``).

Control-plane replay re-creates the CPU actors (admission, batcher, planner, KV pool, weight mover)
from the trace header, feeds each one, in recorded ``seq`` order, exactly the recorded envelopes it
subscribes to (``handle(msg, env.t)``, no event loop, no model), and compares what it returns, in
order, with what that actor published in the recording (envelopes whose ``src`` is its name).
Everything else (client inputs, draft/verifier results, measured timings) is the recorded oracle.

Exit status: 0 no divergence, 1 divergence (or full-replay token mismatch), 2 unreadable trace.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgspec

from nightjar.actors.control import CONTROL_ACTORS, ControlBuildError, build_control_actors, spec_from_header
from nightjar.kernel.bus import Envelope
from nightjar.kernel.messages import Msg
from nightjar.kernel.trace import TraceError, TraceReader

# Measured fields: a replayed actor cannot reproduce wall-clock durations, so they are not compared.
MEASURED_FIELDS = frozenset({"duration_s", "step_time_s", "draft_time_s", "catchup_time_s"})


def same(a: Msg, b: Msg) -> bool:
    """Equal messages, ignoring measured durations."""
    if type(a) is not type(b):
        return False
    if a == b:
        return True
    skip = MEASURED_FIELDS.intersection(a.__struct_fields__)
    return bool(skip) and all(getattr(a, f) == getattr(b, f) for f in a.__struct_fields__ if f not in skip)


def fmt_msg(msg: Msg, width: int = 220) -> str:
    body = msgspec.json.encode(msg).decode()
    return body if len(body) <= width else body[: width - 3] + "..."


def fmt_env(env: Envelope, width: int = 220) -> str:
    return f"{env.seq:>8} {env.t:11.6f} {env.src:<10} {fmt_msg(env.msg, width)}"


@dataclass
class Divergence:
    seq: int                       # the recorded output that differs (or the input, for an extra output)
    actor: str
    expected: Envelope | None
    got: Msg | None
    input_seq: int | None          # the input whose handling produced ``got``
    before: list[Envelope] = field(default_factory=list)
    after: list[Envelope] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"divergence at seq {self.seq} in actor {self.actor!r}"
                 + (f" (replayed output of input seq {self.input_seq})" if self.input_seq else "")]
        expected = fmt_env(self.expected) if self.expected else "(nothing: the recording has no further output)"
        got = fmt_msg(self.got) if self.got is not None else "(nothing: the replayed actor produced no output)"
        lines += [f"  expected: {expected}", f"  got:      {got}"]
        if self.before or self.after:
            lines.append("  context:")
            lines += [("  > " if e.seq == self.seq else "    ") + fmt_env(e, 160) for e in self.before + self.after]
        return "\n".join(lines)


@dataclass
class ReplayResult:
    header: dict
    footer: dict | None
    num_envelopes: int = 0
    last_seq: int = 0
    fed: dict[str, int] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)
    oracles: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    divergence: Divergence | None = None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        lines = [f"{self.num_envelopes} envelopes (last seq {self.last_seq})"
                 + (" [truncated trace: prefix only]" if self.truncated else "")]
        for name in self.fed:
            lines.append(f"  {name:<10} fed {self.fed[name]:>7}  outputs checked {self.checked.get(name, 0):>7}")
        for name, why in self.oracles.items():
            lines.append(f"  {name:<10} not replayed (recorded oracle): {why}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines.append("OK: zero divergences" if self.ok else self.divergence.describe())
        return "\n".join(lines)


class _Replayed:
    __slots__ = ("name", "actor", "pending", "fed", "checked")

    def __init__(self, name, actor):
        self.name, self.actor = name, actor
        self.pending: deque[tuple[int, Msg]] = deque()      # (input seq, replayed output)
        self.fed = self.checked = 0


class ControlReplay:
    """Feed recorded envelopes to freshly built control actors and compare their outputs."""

    def __init__(self, header: dict, actors: Iterable[str] = CONTROL_ACTORS, oracle: Iterable[str] = (),
                 context: int = 4) -> None:
        names = [a for a in actors if a not in set(oracle)]
        built = build_control_actors(spec_from_header(header), names)     # a failure is an error, not an oracle
        self.header = header
        self.states = {n: _Replayed(n, a) for n, a in built.items()}
        self.oracles = {n: "--oracle" for n in oracle}
        self.routes: dict[type, list[_Replayed]] = defaultdict(list)
        for st in self.states.values():
            for t in st.actor.subscribes:
                self.routes[t].append(st)
        self.context = context

    def run(self, envelopes: Iterable[Envelope], until: int | None = None,
            on_env: Callable[[Envelope], None] | None = None, footer: Callable[[], dict | None] = lambda: None
            ) -> ReplayResult:
        res = ReplayResult(self.header, None, oracles=dict(self.oracles))
        recent: deque[Envelope] = deque(maxlen=self.context)
        for st in self.states.values():
            st.pending.extend((0, m) for m in (st.actor.on_start(0.0) or ()))
        it = iter(envelopes)
        for env in it:
            if until is not None and env.seq > until:
                break
            res.num_envelopes += 1
            res.last_seq = env.seq
            if on_env is not None:
                on_env(env)
            recent.append(env)
            div = self._check_output(env) if env.src in self.states else None
            if div is None:
                div = self._feed(env)
            if div is not None:
                div.before = [e for e in recent if e.seq <= div.seq] if div.expected else list(recent)
                div.after = [e for _, e in zip(range(self.context), it)]
                res.divergence = div
                for _ in it:        # read to the end anyway: a damaged file is a TraceError, not a divergence
                    pass
                break
        res.footer = footer()
        if res.divergence is None and until is None:
            res.divergence = self._leftovers(res)
        for st in self.states.values():
            res.fed[st.name], res.checked[st.name] = st.fed, st.checked
        return res

    def _feed(self, env: Envelope) -> Divergence | None:
        for st in self.routes.get(type(env.msg), ()):
            st.fed += 1
            try:
                out = st.actor.handle(env.msg, env.t)
            except Exception as e:      # a crash is a divergence too: report it with its input
                return _crash(st.name, env, e)
            if out:
                st.pending.extend((env.seq, m) for m in out)
        return None

    def _check_output(self, env: Envelope) -> Divergence | None:
        st = self.states[env.src]
        if not st.pending:
            return Divergence(env.seq, st.name, env, None, None)
        in_seq, got = st.pending.popleft()
        if not same(env.msg, got):
            return Divergence(env.seq, st.name, env, got, in_seq or None)
        st.checked += 1
        return None

    def _leftovers(self, res: ReplayResult) -> Divergence | None:
        """Outputs the replay produced after the recording's end: a divergence if the footer says the
        live actor handled that input, otherwise a warning (it was still queued when the engine stopped)."""
        handled = (res.footer or {}).get("handled")
        for st in self.states.values():
            for in_seq, got in st.pending:
                if handled is not None and in_seq <= handled.get(st.name, -1):
                    return Divergence(in_seq, st.name, None, got, in_seq)
            if st.pending:
                kinds = ", ".join(sorted({type(m).__name__ for _, m in st.pending}))
                res.warnings.append(f"{st.name}: {len(st.pending)} replayed output(s) ({kinds}) after the end of "
                                    f"the recording, from inputs the engine may not have delivered before it stopped")
        return None


def _crash(actor: str, env: Envelope, e: Exception) -> Divergence:
    d = Divergence(env.seq, actor, None, None, env.seq)
    d.got = _Crash(f"{type(e).__name__}: {e}")
    return d


class _Crash(Msg, frozen=True):
    """Stands for a replayed actor that raised (reported as its output)."""
    error: str


def _draft_blocks_hint(path: str, allow_schema_drift: bool) -> int:
    """Older headers lack the weight mover's ``draft_blocks``: recover it from the first GrowPool it sent
    (exact), else 1 if it started an offload, else 0 (elastic memory never acted, so any value replays)."""
    from nightjar.kernel.messages import DraftResidency, GrowPool

    started = False
    try:
        for env in TraceReader(path, allow_schema_drift=allow_schema_drift, allow_truncated=True):
            if env.src == "weights" and isinstance(env.msg, GrowPool):
                return env.msg.num_blocks
            started = started or (env.src == "weights" and isinstance(env.msg, DraftResidency)
                                  and env.msg.state == "OFFLOADING")
    except TraceError:
        pass
    return 1 if started else 0


def replay_file(path: str, *, until: int | None = None, actors: Iterable[str] = CONTROL_ACTORS,
                oracle: Iterable[str] = (), on_env=None, allow_schema_drift: bool = False,
                allow_truncated: bool = False, context: int = 4) -> ReplayResult:
    """Control-plane replay of a trace file (raises TraceError on an unreadable file)."""
    reader = TraceReader(path, allow_schema_drift=allow_schema_drift, allow_truncated=allow_truncated)
    header = dict(reader.header)
    if "draft_blocks" not in header and header.get("draft") is not None:
        header["draft_blocks_hint"] = _draft_blocks_hint(path, allow_schema_drift)
    rep = ControlReplay(header, actors, oracle, context)
    res = rep.run(reader, until, on_env, footer=lambda: reader.footer)
    res.truncated = reader.truncated
    if reader.schema_drift:
        res.warnings.append("the trace was recorded with a different message schema (--allow-schema-drift)")
    return res


# ---- full replay (models) -------------------------------------------------------------------------
@dataclass
class RecordedRequest:
    req_id: int
    t: float
    submit: Any
    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    aborted: bool = False


def recorded_requests(envs: Iterable[Envelope]) -> dict[int, RecordedRequest]:
    """Client submissions and the tokens the batcher committed for each, from a trace."""
    from nightjar.kernel.messages import AbortRequest, SubmitRequest, TokensCommitted

    reqs: dict[int, RecordedRequest] = {}
    for env in envs:
        m = env.msg
        if isinstance(m, SubmitRequest):
            reqs[m.req_id] = RecordedRequest(m.req_id, env.t, m)
        elif isinstance(m, AbortRequest) and m.req_id in reqs:
            reqs[m.req_id].aborted = True
        elif isinstance(m, TokensCommitted):
            pos = 0
            for rid, n, fin in zip(m.req_ids, m.counts, m.finish):
                r = reqs.get(rid)
                if r is not None:
                    r.tokens.extend(m.tokens[pos: pos + n])
                    r.finish = fin or r.finish
                pos += n
    return reqs


@dataclass
class FullReplayResult:
    exact: int = 0
    mismatched: list[int] = field(default_factory=list)       # greedy / seeded requests
    informational: list[int] = field(default_factory=list)    # sampled under a timing-dependent γ schedule
    skipped: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def full_replay(path: str, loaded=None, *, allow_schema_drift: bool = False, speed: float = 1.0,
                **engine_overrides) -> FullReplayResult:
    """Re-run the recorded requests through a real Engine with the recorded config; compare tokens.

    Greedy and seeded sampled requests must match exactly (seeded sampling does not depend on γ);
    unseeded sampled ones are only reported. Requests the client aborted are re-run to their recorded length."""
    import asyncio

    from nightjar.actors.control import header_config
    from nightjar.engine import Engine
    from nightjar.sampling import SamplingParams

    reader = TraceReader(path, allow_schema_drift=allow_schema_drift)
    reqs = recorded_requests(reader)
    cfg = msgspec.to_builtins(header_config(reader.header))
    cfg.update(trace=None, **engine_overrides)
    res = FullReplayResult()
    t0 = min((r.t for r in reqs.values()), default=0.0)

    async def one(eng, r: RecordedRequest):
        sp = r.submit.sampling
        max_tokens = len(r.tokens) if r.aborted else sp.max_tokens
        if max_tokens < 1:
            res.skipped += 1
            return
        await asyncio.sleep(max(0.0, (r.t - t0) / speed))
        params = SamplingParams(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                seed=sp.seed, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                                min_tokens=min(sp.min_tokens, max_tokens))
        got = []
        async for out in eng.generate(list(r.submit.prompt_ids), params, request_id=r.req_id,
                                      speculate=r.submit.speculate):
            got += out.token_ids
        strict = sp.temperature <= 0 or sp.seed is not None
        if got == r.tokens:
            res.exact += 1
        else:
            (res.mismatched if strict else res.informational).append(r.req_id)
            res.details.append(f"request {r.req_id}: recorded {r.tokens[:12]}... ({len(r.tokens)}) "
                               f"replayed {got[:12]}... ({len(got)})")

    async def main():
        model, draft, policy = cfg.pop("model"), cfg.pop("draft"), cfg.pop("policy")
        async with Engine(model, draft, policy, loaded=loaded, **cfg) as eng:
            await asyncio.gather(*[one(eng, r) for r in reqs.values()])
    asyncio.run(main())
    return res


# ---- CLI --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar replay", description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--until", type=int, default=None, help="stop after this seq")
    p.add_argument("--show", default=None, help="print envelopes of these message types (comma-separated, or 'all')")
    p.add_argument("--full", action="store_true", help="also re-run the requests through a real engine (models)")
    p.add_argument("--actors", default=",".join(CONTROL_ACTORS), help="actors to replay (comma-separated)")
    p.add_argument("--oracle", default="", help="actors to treat as recorded oracles instead (comma-separated)")
    p.add_argument("--context", type=int, default=4, help="envelopes of context around a divergence")
    p.add_argument("--allow-schema-drift", action="store_true", help="read a trace recorded with another schema")
    p.add_argument("--allow-truncated", action="store_true", help="replay the whole frames of a cut-off trace")
    return p


def _show_filter(spec: str | None):
    if not spec:
        return None
    kinds = {s.strip() for s in spec.split(",") if s.strip()}

    def show(env: Envelope) -> None:
        if "all" in kinds or type(env.msg).__name__ in kinds:
            print(fmt_env(env))
    return show


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]   # noqa: E731
    unknown = sorted(set(split(a.actors) + split(a.oracle)) - set(CONTROL_ACTORS))
    if unknown:
        print(f"nightjar replay: error: unknown actor(s) {', '.join(unknown)}; choose from "
              f"{', '.join(CONTROL_ACTORS)}", file=sys.stderr)
        return 2
    try:
        res = replay_file(a.file, until=a.until, actors=split(a.actors), oracle=split(a.oracle),
                          on_env=_show_filter(a.show), allow_schema_drift=a.allow_schema_drift,
                          allow_truncated=a.allow_truncated, context=a.context)
    except (TraceError, OSError) as e:
        print(f"nightjar replay: {e}", file=sys.stderr)
        return 2
    except ControlBuildError as e:
        print(f"nightjar replay: {e} (pass --oracle to treat that actor as recorded)", file=sys.stderr)
        return 1
    print(res.summary())
    if not res.ok:
        return 1
    if a.full:
        full = full_replay(a.file, allow_schema_drift=a.allow_schema_drift)
        print(f"full replay: {full.exact} requests identical, {len(full.mismatched)} mismatched, "
              f"{len(full.informational)} unseeded sampled requests differ (their draws follow γ), "
              f"{full.skipped} skipped")
        for line in full.details[:10]:
            print("  " + line)
        return 0 if full.ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
