"""Ray Serve replicas vs the single-process server, same closed-loop load, on the real pair (SmolLM2 +
the shipped draft, default engine flags):

  A  ``nightjar serve`` (one process, torch on every core)
  B  one Serve replica with 2 CPUs (``--replicas 1 --replica-cpus 2``)
  C  two Serve replicas with 1 CPU each (``--replicas 2 --replica-cpus 1``)

All three are up at once (B and C as two Serve apps under /one and /two on one Ray; Ray's CPUs are logical,
so the two apps can both hold their reservations), and the loads are interleaved A, B, C with the order
rotated each repetition; each load is ``nightjar bench serve --closed-loop N`` unchanged against the URL.
Then one stream at a time (closed loop 1) against A and B: the Serve path's overhead.

    .venv/bin/python bench/serve_replicas.py [--reps 2] [--clients 4] [--prompts 24] [--output-len 48]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PY = sys.executable


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(1)
    raise SystemExit(f"{url}/health did not answer within {timeout_s} s")


def bench(url: str, clients: int, prompts: int, output_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [PY, "-m", "nightjar", "bench", "serve", "--base-url", url, "--closed-loop", str(clients),
           "--num-prompts", str(prompts), "--output-len", str(output_len), "--ignore-eos", "--temperature", "0",
           "--num-warmups", "1", "--save-result", path, "--disable-tqdm", "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        r = json.load(f)
    os.unlink(path)
    if r["errors"]:
        raise SystemExit(f"{url}: errors {r['errors']}")
    return r


def row(name: str, rs: list[dict], base: list[dict] | None) -> str:
    thr = statistics.median(r["output_throughput"] for r in rs)
    ttft = statistics.median(r["mean_ttft_ms"] for r in rs)
    e2e = statistics.median(r["mean_e2el_ms"] for r in rs)
    tpot = statistics.median(r["mean_tpot_ms"] for r in rs)
    ratio = ""
    if base is not None:
        ratio = f"{thr / statistics.median(b['output_throughput'] for b in base):.2f}x"
    each = ", ".join(f"{r['output_throughput']:.1f}" for r in rs)
    return f"| {name} | {thr:.1f} | {ratio or '1.00x'} | {ttft:.0f} | {tpot:.1f} | {e2e:.0f} | {each} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--single-prompts", type=int, default=8)
    ap.add_argument("--port-a", type=int, default=8311)
    ap.add_argument("--port-serve", type=int, default=8312)
    a = ap.parse_args(argv)

    import ray

    from nightjar.deploy.cluster import ClusterOptions, start
    from nightjar.engine_args import add_engine_args, engine_kwargs
    from nightjar.kernel.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kwargs = engine_kwargs(p.parse_args([]))
    model = str(kwargs.get("model") or EngineConfig().model)
    proc = subprocess.Popen([PY, "-m", "nightjar", "serve", "--port", str(a.port_a)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        urls = {"A single process": f"http://127.0.0.1:{a.port_a}"}
        for name, app, n, cpus in [("B 1 replica x 2 CPUs", "one", 1, 2.0), ("C 2 replicas x 1 CPU", "two", 2, 1.0)]:
            opts = ClusterOptions(num_replicas=n, replica_cpus=cpus, port=a.port_serve)
            urls[name] = start(kwargs, model, opts, app_name=app, route_prefix=f"/{app}")
        for u in urls.values():
            wait_healthy(u)
        names = list(urls)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(a.reps):
            order = names[rep % 3:] + names[:rep % 3]
            for n in order:
                runs[n].append(bench(urls[n], a.clients, a.prompts, a.output_len))
                print(f"rep {rep + 1} {n}: {runs[n][-1]['output_throughput']:.1f} tok/s", file=sys.stderr)
        single: dict[str, list[dict]] = {n: [] for n in names[:2]}
        for rep in range(a.reps):
            for n in names[:2] if rep % 2 == 0 else names[1::-1]:
                single[n].append(bench(urls[n], 1, a.single_prompts, a.output_len))
        print(f"closed loop {a.clients} clients x {a.prompts} requests, {a.output_len} output tokens (ignore_eos), "
              f"median of {a.reps} interleaved runs; output tok/s, mean TTFT ms, mean TPOT ms, mean E2E ms")
        print("| setup | out tok/s | vs A | TTFT ms | TPOT ms | E2E ms | runs (tok/s) |")
        print("|---|---|---|---|---|---|---|")
        for n in names:
            print(row(n, runs[n], runs[names[0]] if n != names[0] else None))
        print(f"\none stream at a time ({a.single_prompts} requests x {a.output_len} tokens, median of {a.reps}):")
        print("| setup | out tok/s | vs A | TTFT ms | TPOT ms | E2E ms | runs (tok/s) |")
        print("|---|---|---|---|---|---|---|")
        for n in single:
            print(row(n, single[n], single[names[0]] if n != names[0] else None))
    finally:
        proc.terminate()
        proc.wait(30)
        if ray.is_initialized():
            from ray import serve
            serve.shutdown()
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
