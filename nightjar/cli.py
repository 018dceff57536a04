"""The ``nightjar`` command line: serve, generate, models, distill, bench, replay, trace, simulate, profile."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

from nightjar.actors.control import ControlBuildError
from nightjar.argtypes import positive
from nightjar.config_check import check_config
from nightjar.engine_args import add_engine_args, engine_kwargs
from nightjar.kernel.config import EngineConfig
from nightjar.sampling import ConfigError


def cmd_generate(a: argparse.Namespace) -> int:
    import asyncio

    from nightjar.engine import Engine
    from nightjar.sampling import SamplingParams

    async def run():
        async with Engine(**engine_kwargs(a), trace=a.trace) as eng:
            prompt = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
            params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed_sampling,
                                    top_p=a.top_p, top_k=a.top_k, stop=a.stop or [])
            t0, ids, text, fin = time.perf_counter(), [], "", None
            async for out in eng.generate(prompt, params):
                ids += out.token_ids
                text, fin = out.text, out.finish_reason
                if not a.json:
                    print(out.text_delta, end="", flush=True)
            dt = time.perf_counter() - t0
            s = eng.stats
            stats = {"steps": s.steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                     "tree_hits": s.tree_hits, "tokens_per_s": round(len(ids) / dt, 2) if dt > 0 else 0.0}
            if a.json:
                print(json.dumps({"text": text, "token_ids": ids, "finish_reason": fin, "stats": stats}))
            else:
                print(f"\n[{fin}] {len(ids)} tokens, {stats['tokens_per_s']} tok/s, "
                      f"accepted {s.accepted_tokens}/{s.draft_tokens} drafts"
                      + (f", {s.tree_hits} runner-up drafts taken" if s.tree_hits else ""), file=sys.stderr)
    asyncio.run(run())
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    if a.replicas is not None or a.min_replicas is not None or a.max_replicas is not None:
        return _serve_cluster(a)
    try:
        app = importlib.import_module("nightjar.api.app")
    except ImportError as e:
        print(f"the server is not available: {e}", file=sys.stderr)
        return 1
    limits = app.ServerLimits(header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
                              max_connections=a.max_connections, keepalive_timeout_s=a.keepalive_timeout)
    app.serve(engine_kwargs(a), host=a.host, port=a.port, api_key=a.api_key, trace=a.trace, limits=limits)
    return 0


def _serve_cluster(a: argparse.Namespace) -> int:
    """``serve --replicas N``: N engines on Ray Serve (nightjar/deploy); mistakes exit 2 with one line."""
    try:
        import ray  # noqa: F401

        from nightjar.deploy.cluster import ClusterOptions, serve_cluster
    except ImportError as e:
        print(f"nightjar serve: error: --replicas needs Ray Serve ({e}): pip install -e '.[ray]'", file=sys.stderr)
        return 2
    opts = ClusterOptions(num_replicas=a.replicas or 1, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                          target_ongoing_requests=a.target_ongoing_requests,
                          max_ongoing_requests=a.max_ongoing_requests, replica_cpus=a.replica_cpus,
                          replica_gpus=a.replica_gpus, ray_address=a.ray_address, host=a.host, port=a.port,
                          api_key=a.api_key)
    try:
        opts.check()
        if a.trace is not None:
            raise ValueError("--trace is per process: not supported with --replicas")
        given = ["--" + k.replace("_", "-") for k, default in CLIENT_LIMITS.items() if getattr(a, k) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: not supported with --replicas (Ray Serve's HTTP proxy holds "
                             "the client connections, not Nightjar's server)")
        serve_cluster(engine_kwargs(a), opts)
    except (ValueError, ConnectionError, RuntimeError) as e:
        if os.environ.get("NIGHTJAR_DEBUG"):
            raise
        print(f"nightjar serve: error: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 2
    return 0


def _cluster_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("replicas (Ray Serve; needs the [ray] extra)")
    g.add_argument("--replicas", type=positive(int), default=None, metavar="N",
                   help="serve N engine replicas behind one endpoint on Ray Serve (num_replicas)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, or head-ip:6379) instead of starting a local one")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscale between --min-replicas and --max-replicas on ongoing requests")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N")
    g.add_argument("--target-ongoing-requests", type=positive(float), default=16.0, metavar="N",
                   help="autoscaling target of ongoing requests per replica (default 16)")
    g.add_argument("--max-ongoing-requests", type=positive(int), default=64, metavar="N",
                   help="requests Serve sends one replica at once (default 64)")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs per replica (default 1)")
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="G", help="GPUs per replica (default 0)")


CLIENT_LIMITS = {"header_timeout": 10.0, "body_timeout": 30.0, "max_connections": 512, "keepalive_timeout": 75.0}


def _server_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require this Bearer key on /v1/*. A key given here is visible to every local user in "
                        "the process list (ps); prefer the NIGHTJAR_API_KEY environment variable, which is read "
                        "when this flag is absent")
    g = s.add_argument_group("client limits")
    g.add_argument("--header-timeout", type=positive(float), default=CLIENT_LIMITS["header_timeout"], metavar="S",
                   help="seconds from a request's first byte to its complete head; slower clients are dropped "
                        "(default 10)")
    g.add_argument("--body-timeout", type=positive(float), default=CLIENT_LIMITS["body_timeout"], metavar="S",
                   help="seconds to receive a request body; slower clients get a 408 and are dropped (default 30)")
    g.add_argument("--max-connections", type=positive(int), default=CLIENT_LIMITS["max_connections"], metavar="N",
                   help="open client connections; more get a 503 and are closed (default 512)")
    g.add_argument("--keepalive-timeout", type=positive(float), default=CLIENT_LIMITS["keepalive_timeout"],
                   metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 75)")


def cmd_models(a: argparse.Namespace) -> int:
    from nightjar.models import NAMED_DRAFTS, hub, shipped

    if a.action == "pull":
        for name in a.names or [hub.DEFAULT_MODEL]:
            path = hub.pull(name, quiet=a.quiet)
            if not a.quiet:
                print(f"{name}: {path}")
        return 0
    for name, entry in hub.REGISTRY.items():
        state = "pulled" if hub.is_pulled(name) else "not pulled"
        print(f"{name:18s} {state:10s} {entry.description}")
    for name in ("default", "independent"):
        d = NAMED_DRAFTS[name]
        state = "shipped" if shipped(d) else "missing (a random draft is used)"
        print(f"{name + ' draft':18s} {state:10s} {d}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar", description="Nightjar: LLM serving with adaptive speculative "
                                "decoding and elastic draft memory.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s, serve=True)
    _server_args(s)
    _cluster_args(s)
    s.set_defaults(func=cmd_serve)
    g = sub.add_parser("generate", help="generate once from a prompt (one user chat message unless --raw)")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", dest="seed_sampling", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate, inline_compute=True)   # one request: the loop has nothing else to serve
    m = sub.add_parser("models", help="pull or list models")
    m.add_argument("action", choices=["pull", "list"])
    m.add_argument("names", nargs="*")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(func=cmd_models)
    for name, text in [
        ("distill", "train the default draft by distillation"), ("bench", "benchmarks: serve, compare"),
        ("replay", "replay a recorded trace"), ("trace", "inspect a trace: summary"),
        ("simulate", "what-if simulation on the same actors"), ("profile", "measure this machine's step times"),
    ]:
        sub.add_parser(name, help=f"{text} (see `nightjar {name} --help`)", add_help=False)
    return p


# Mistakes in a command's input (bad values, missing files, unbuildable settings) end in one line and exit 2;
# NIGHTJAR_DEBUG=1 shows the traceback instead.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
               ControlBuildError)

DELEGATED = {"distill": "nightjar.training.distill", "bench": "nightjar.bench.cli",
             "replay": "nightjar.offline.replay", "trace": "nightjar.offline.trace_summary",
             "simulate": "nightjar.offline.sim.cluster", "profile": "nightjar.offline.profile"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:          # these parse their own flags (argparse would eat "--x")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:]) or 0
        except USER_ERRORS as e:
            if os.environ.get("NIGHTJAR_DEBUG"):
                raise
            print(f"nightjar {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(a, "api_key", None) is None and a.cmd == "serve":
        a.api_key = os.environ.get("NIGHTJAR_API_KEY")
    if getattr(a, "seed", None) is not None and a.cmd == "generate" and a.seed_sampling is None:
        a.seed_sampling = a.seed
    try:
        if hasattr(a, "policy"):                 # engine flags: checked before any model loads
            kw = engine_kwargs(a)
            if kw["planner_profile"] == "auto":  # checked first: measuring may take ~30 s
                check_config(EngineConfig(**kw))
                from nightjar.profile_cache import cached_profile
                a.planner_profile = cached_profile(a.model, a.draft, a.dtype, a.block_size, a.device,
                                                   log=lambda s: print(s, file=sys.stderr),
                                                   quantization=a.quantization,
                                                   draft_quantization=a.draft_quantization)
            check_config(EngineConfig(**engine_kwargs(a)))
        return a.func(a) or 0
    except ConfigError as e:
        print(f"nightjar {a.cmd}: error: argument {e.flag}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
