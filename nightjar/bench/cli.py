"""``nightjar bench serve | compare | trace-info`` (see ``docs/bench_harness.md``)."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

from nightjar.argtypes import positive
from nightjar.bench.datasets import DATASETS, DatasetError
from nightjar.bench.metrics import parse_goodput, parse_metric_names, parse_percentiles
from nightjar.bench.runner import BenchOptions
from nightjar.offline.arrivals import TraceError, load_trace


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of req/s or 'inf')") from None
    if not v > 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return v


def add_load_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="prompts", choices=DATASETS)
    d.add_argument("--dataset-path", default=None, help="custom: a JSONL file of {\"prompt\", \"max_tokens\"?}")
    d.add_argument("--split", default="auto", choices=["auto", "heldout", "train", "all"],
                   help="bundled prompts: auto = heldout if it has enough prompts, else all")
    d.add_argument("--num-prompts", type=positive(int), default=None,
                   help="requests to send (default 200; with --trace: cap on the trace's arrivals)")
    d.add_argument("--output-len", type=positive(int), default=None, help="override every request's max_tokens")
    d.add_argument("--random-input-len", type=positive(int), default=128)
    d.add_argument("--random-output-len", type=positive(int), default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--tokenizer", default="auto",
                   help="for prompt lengths: auto (the pulled SmolLM2 GGUF), words (1.3 tok/word), or a path")
    d.add_argument("--max-total-len", type=int, default=2048 - 64,
                   help="lower max_tokens so prompt + output fit (0: off)")
    d.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s (Poisson/gamma) or inf")
    a.add_argument("--burstiness", type=positive(float), default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier; θ = 1/(rate·burstiness)")
    a.add_argument("--trace", default=None, help="phased schedule JSON (or a shipped name: spike, oscillation, ...)")
    a.add_argument("--trace-rate-scale", type=positive(float), default=1.0, help="multiply every phase's rate")
    a.add_argument("--trace-time-scale", type=positive(float), default=1.0, help="multiply every phase's duration")
    a.add_argument("--closed-loop", type=positive(int), default=None, metavar="N",
                   help="N clients, each sending its next request when the previous one ends")
    a.add_argument("--duration", type=positive(float), default=None, help="closed loop: seconds (default 60)")
    a.add_argument("--max-concurrency", type=positive(int), default=None)
    r = p.add_argument_group("requests")
    r.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    r.add_argument("--endpoint-type", default="chat", choices=["chat", "completions"])
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action="store_true")
    r.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    r.add_argument("--api-key", default=None)
    r.add_argument("--request-timeout", type=positive(float), default=600.0)
    r.add_argument("--num-warmups", type=int, default=None, help="unmeasured requests first (serve 0, compare 1)")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="50,99")
    o.add_argument("--timeline-interval", type=float, default=1.0, help="s between /metrics polls (0: off)")
    o.add_argument("--save-result", "--output-json", dest="output_json", default=None, metavar="PATH")
    o.add_argument("--save-detailed", action="store_true", help="per-request ITLs and texts in the JSON")
    o.add_argument("--plot", default=None, metavar="PATH.png")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no markdown table on stdout")


def options_from_args(a: argparse.Namespace, default_warmups: int = 0) -> BenchOptions:
    if a.trace and a.closed_loop:
        raise ValueError("--trace and --closed-loop are exclusive")
    extra = {}
    if a.extra_body:
        extra = json.loads(a.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    num = a.num_prompts
    if num is None and not a.trace and not a.closed_loop:
        num = 200
    return BenchOptions(
        dataset_name=a.dataset_name, dataset_path=a.dataset_path, split=a.split, num_prompts=num,
        output_len=a.output_len, random_input_len=a.random_input_len, random_output_len=a.random_output_len,
        random_range_ratio=a.random_range_ratio, tokenizer=a.tokenizer, max_total_len=a.max_total_len or None,
        seed=a.seed, request_rate=a.request_rate, burstiness=a.burstiness, trace=a.trace,
        trace_rate_scale=a.trace_rate_scale, trace_time_scale=a.trace_time_scale, closed_loop=a.closed_loop,
        duration_s=a.duration or (60.0 if a.closed_loop else None), max_concurrency=a.max_concurrency,
        model=a.model, endpoint_type=a.endpoint_type, temperature=a.temperature, ignore_eos=a.ignore_eos,
        extra_body=extra, api_key=a.api_key, request_timeout_s=a.request_timeout,
        num_warmups=default_warmups if a.num_warmups is None else a.num_warmups,
        goodput=parse_goodput(a.goodput), percentile_metrics=parse_metric_names(a.percentile_metrics),
        metric_percentiles=parse_percentiles(a.metric_percentiles), timeline_interval_s=a.timeline_interval,
        progress=not a.disable_tqdm, save_detailed=a.save_detailed)


def _first_model(base_url: str, api_key: str | None) -> str | None:
    """The server's first model; a server that cannot be reached is a one-line error (ValueError)."""
    import urllib.error
    import urllib.request
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())["data"]
            return data[0]["id"] if data else None
    except urllib.error.HTTPError:
        return None                       # it answers (e.g. 401 without --api-key): let the run report it
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot reach {url} ({e}); start a server (nightjar serve) or pass --launch") from None


def _emit(result: dict, a: argparse.Namespace, opts: BenchOptions) -> None:
    from nightjar.bench.report import markdown_summary, plot_result, write_json
    if not a.quiet:
        print(markdown_summary(result, opts.percentile_metrics, opts.metric_percentiles))
        if result.get("per_phase"):
            print("\n| phase | kind | rate | requests | out tok/s | mean TTFT (ms) | mean E2E (ms) | mean γ |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|")
            for r in result["per_phase"]:
                f = lambda v, nd=1: "-" if v is None else f"{v:,.{nd}f}"  # noqa: E731
                print(f"| {r['phase']} | {r['kind'] or '-'} | {r['rate']:g} | {r['completed']}/{r['num_requests']} | "
                      f"{f(r['output_tokens_per_s'])} | {f(r['mean_ttft_ms'], 0)} | {f(r['mean_e2el_ms'], 0)} | "
                      f"{f(r.get('gamma_mean'), 2)} |")
        if result.get("errors"):
            print("\nerrors: " + "; ".join(f"{n}× {e}" for e, n in result["errors"].items()))
    if a.output_json:
        print(f"result: {write_json(result, a.output_json)}", file=sys.stderr)
    if a.plot:
        print(f"plot: {plot_result(result, a.plot)}", file=sys.stderr)


def _server_context(a: argparse.Namespace, entry: str):
    """in-process / launched subprocess / nothing (an already running server at --base-url).
    ``entry`` is a policy, or ``POLICY@EXTRA SERVER ARGS`` (bench compare's per-entry flags)."""
    from nightjar.bench.compare import split_variant
    from nightjar.bench.server import InProcessServer, SubprocessServer, engine_factory_from_args
    policy, extra = split_variant(entry)
    server_args = f"{a.server_args} {extra}".strip()
    if a.in_process:
        make, model = engine_factory_from_args(server_args, policy, a.server_model)
        return InProcessServer(make, model)
    return SubprocessServer(policy, server_args, model=a.server_model, startup_timeout_s=a.startup_timeout,
                            log_path=None)


def cmd_serve(a: argparse.Namespace, argv: list[str]) -> int:
    from nightjar.bench.report import command_line
    from nightjar.bench.runner import prepare, run_prepared
    opts = options_from_args(a, 0)
    prep = prepare(opts)
    ctx = _server_context(a, a.policy) if (a.in_process or a.launch) else contextlib.nullcontext()
    with ctx as srv:
        base = srv.base_url if srv is not None else a.base_url
        if opts.model is None and not a.in_process and not a.launch:
            opts.model = _first_model(base, opts.api_key)
        extra = {"command": command_line(argv)}
        if a.in_process or a.launch:
            extra["policy"] = a.policy
        result = run_prepared(opts, prep, base, title=f"Serving benchmark: {base}", extra=extra)
    _emit(result, a, opts)
    return 0 if result["completed"] else 1


def cmd_compare(a: argparse.Namespace, argv: list[str]) -> int:
    from nightjar.bench.compare import markdown_compare, parse_policies, run_compare
    from nightjar.bench.report import command_line, plot_compare, write_json
    opts = options_from_args(a, 1)
    policies = parse_policies(a.policies)
    repeats = a.repeats
    summary = run_compare(opts, policies, lambda pol: _server_context(a, pol), repeats=repeats,
                          runs_dir=a.runs_dir, command=command_line(argv),
                          mode="in-process" if a.in_process else "subprocess", server_args=a.server_args,
                          log=lambda s: print(s, file=sys.stderr))
    if not a.quiet:
        print(markdown_compare(summary))
    if a.output_json:
        print(f"result: {write_json(summary, a.output_json)}", file=sys.stderr)
    if a.plot:
        print(f"plot: {plot_compare(summary, a.plot)}", file=sys.stderr)
    return 0 if all(s["num_ok"] for s in summary["policies"].values()) else 1


def cmd_trace_info(a: argparse.Namespace, argv: list[str]) -> int:
    for path in a.traces:
        t = load_trace(path).scaled(a.trace_rate_scale, a.trace_time_scale)
        print(f"## {t.name}: {t.duration_s:g} s, ~{t.expected_requests():.0f} requests"
              + (f"\n{t.description}" if t.description else ""))
        print("| phase | kind | start (s) | duration (s) | rate (req/s) | burstiness | expected requests |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for i, (ph, s) in enumerate(zip(t.phases, t.boundaries)):
            print(f"| {i} | {ph.kind or '-'} | {s:g} | {ph.duration_s:g} | {ph.rate:g} | {ph.burstiness:g} | "
                  f"{ph.rate * ph.duration_s:.1f} |")
        print()
    return 0


def _server_args(p: argparse.ArgumentParser, single: bool) -> None:
    s = p.add_argument_group("server")
    if single:
        s.add_argument("--base-url", default="http://127.0.0.1:8000", help="an OpenAI-compatible server")
        s.add_argument("--launch", action="store_true", help="start a fresh `nightjar serve` subprocess instead")
        s.add_argument("--policy", default="nightjar", help="with --launch / --in-process")
    s.add_argument("--in-process", action="store_true",
                   help="build the Engine and app in this process on a loopback port")
    s.add_argument("--server-args", default="",
                   help='extra `nightjar serve` flags, e.g. "--dtype float32 --num-blocks 512"')
    s.add_argument("--server-model", default=None, help="--model for the launched server")
    s.add_argument("--startup-timeout", type=float, default=600.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar bench", description="Serving benchmarks (vLLM `bench serve` flags).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="load an OpenAI-compatible endpoint and report latency/throughput")
    add_load_args(s)
    _server_args(s, True)
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("compare", help="several policies on the same arrivals, each on a fresh server")
    c.add_argument("--policies", required=True, help="comma-separated, e.g. off,fixed:2,fixed:4,nightjar; an "
                   "entry POLICY@FLAGS adds server flags for it alone, e.g. nightjar@--quantization int4")
    c.add_argument("--repeats", type=positive(int), default=3)
    c.add_argument("--runs-dir", default=None, help="save every run's full JSON and PNG here")
    add_load_args(c)
    _server_args(c, False)
    c.set_defaults(func=cmd_compare)
    t = sub.add_parser("trace-info", help="print the phases of trace files")
    t.add_argument("traces", nargs="+")
    t.add_argument("--trace-rate-scale", type=positive(float), default=1.0)
    t.add_argument("--trace-time-scale", type=positive(float), default=1.0)
    t.set_defaults(func=cmd_trace_info)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return a.func(a, argv) or 0
    except (TraceError, DatasetError, ValueError) as e:
        print(f"nightjar bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
