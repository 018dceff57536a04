"""Soak: a real ``nightjar serve`` under a tight ``--device-memory`` budget, driven with mixed traffic and
cut streams for N minutes, then checked.

    .venv/bin/python bench/soak.py --minutes 3 [--device-memory 412000000] [--concurrency 24]
                                   [--rounds 3] [--output-json soak.json] [--server-args "..."]

Each round is a burst (``--concurrency`` workers) then a calm tail (one worker), then no load: the script
waits for the server to settle and samples it. Traffic (loopback only; every loop is bounded by time and
count): chat and completions, streamed and not, streams cut after a few chunks, long token-id prompts
that press the KV pool, Japanese answers cut by max_tokens, prompts one token over the advertised
context, malformed JSON; and once a round the slow-client probes: a request head trickled at 1 byte/s,
a request aiohttp's parser refuses (Transfer-Encoding with Content-Length), 30,000 empty chat messages
(with /health polled meanwhile).

Checks (exit status 1 if one fails): no 5xx and no client-side error; no traceback and no ERROR line in the
server log; after each round every KV block free and the draft resident again; at least one offload and
as many reloads; RSS flat across rounds (sampled ``--idle-s`` after the server went idle, after its idle
``malloc_trim``; the second half of the rounds within ``--rss-tolerance-mib``); no answer ending
in U+FFFD; the trickled head dropped within the header timeout; the parser-refused request answered 400.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from nightjar.bench.server import SubprocessServer

PROMPTS = ["Explain how a bicycle gear works.", "Write a haiku about autumn.", "What is the capital of France?",
           "List three uses of copper.", "Summarize the plot of a detective story in two sentences.",
           "How do I boil an egg?", "Give me a short motivational quote.", "Translate 'good morning' to Spanish."]
JAPANESE = ["日本語で自己紹介をしてください。", "東京の天気について教えてください。",
            "日本の四季について書いてください。"]
KINDS = {"chat": 30, "stream": 20, "cut": 20, "long": 10, "japanese": 10, "too_long": 5, "bad_json": 5}
MAX_REQUESTS_PER_WORKER = 100_000


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    client_errors: Counter = field(default_factory=Counter)
    unexpected: list = field(default_factory=list)
    fffd_endings: int = 0
    cut_streams: int = 0
    length_cut_japanese: int = 0

    def status(self, kind: str, status: int, expected: tuple[int, ...] = (200,)) -> None:
        self.statuses[status] += 1
        self.kinds[kind] += 1
        if status not in expected and len(self.unexpected) < 20:
            self.unexpected.append((kind, status))


# ---- one request of each kind ---------------------------------------------------------------------
async def chat(s, rng, t: Tally, model):
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(8, 48), **sampling(rng)}
    async with s.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
        t.status("chat", r.status)
        if r.status == 200:
            check_text(t, data["choices"][0]["message"]["content"])


async def stream(s, rng, t: Tally, model, cut: bool = False):
    kind = "cut" if cut else "stream"
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 64), "stream": True,
            "ignore_eos": cut, **sampling(rng)}
    async with s.post("/v1/completions", json=body) as r:
        t.status(kind, r.status)
        if r.status != 200:
            return
        text, events = "", 0
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            events += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if cut and events >= rng.randint(2, 4):
                t.cut_streams += 1
                r.close()                       # the client goes away mid-stream
                return
        check_text(t, text)


async def long_prompt(s, rng, t: Tally, model, context: int):
    n = rng.randint(context // 4, int(context * 0.7))
    body = {"model": model, "prompt": [rng.randint(1000, 20000) for _ in range(n)], "max_tokens": rng.randint(4, 24),
            "temperature": 0}
    async with s.post("/v1/completions", json=body) as r:
        await r.read()
        t.status("long", r.status)


async def japanese(s, rng, t: Tally, model):
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(JAPANESE)}],
            "max_tokens": rng.randint(3, 40), "temperature": 0.8, "seed": rng.randint(0, 1000)}
    async with s.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
        t.status("japanese", r.status)
        if r.status == 200:
            choice = data["choices"][0]
            t.length_cut_japanese += choice["finish_reason"] == "length"
            check_text(t, choice["message"]["content"])


async def too_long(s, rng, t: Tally, model, context: int):
    body = {"model": model, "prompt": [rng.randint(1000, 20000) for _ in range(context)], "max_tokens": 1}
    async with s.post("/v1/completions", json=body) as r:
        code = (await r.json())["error"]["code"]
        t.status("too_long", r.status, expected=(400,))
        if code != "context_length_exceeded":
            t.unexpected.append(("too_long", code))


async def bad_json(s, rng, t: Tally, model):
    headers = {"Content-Type": "application/json"}
    async with s.post("/v1/chat/completions", data=b'{"messages": [', headers=headers) as r:
        await r.read()
        t.status("bad_json", r.status, expected=(400,))


def sampling(rng) -> dict:
    return {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randint(0, 10_000)}


def check_text(t: Tally, text: str) -> None:
    t.fffd_endings += text.endswith("\ufffd")


# ---- load --------------------------------------------------------------------------------------------
async def worker(s, seed: int, until: float, t: Tally, model: str, context: int) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    for _ in range(MAX_REQUESTS_PER_WORKER):
        if time.monotonic() >= until:
            return
        kind = rng.choices(kinds, weights)[0]
        try:
            match kind:
                case "chat":
                    await chat(s, rng, t, model)
                case "stream":
                    await stream(s, rng, t, model)
                case "cut":
                    await stream(s, rng, t, model, cut=True)
                case "long":
                    await long_prompt(s, rng, t, model, context)
                case "japanese":
                    await japanese(s, rng, t, model)
                case "too_long":
                    await too_long(s, rng, t, model, context)
                case "bad_json":
                    await bad_json(s, rng, t, model)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            t.client_errors[f"{kind}: {type(e).__name__}"] += 1


# ---- slow-client probes ------------------------------------------------------------------------------
async def trickled_head(port: int, header_timeout: float) -> float:
    """Seconds until the server drops a client sending its head at 1 byte/s (inf if it never does)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"a" * 200
    try:
        for b in head:
            writer.write(bytes([b]))
            try:
                if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                    return time.monotonic() - t0
            except (asyncio.TimeoutError, TimeoutError):
                pass
            except ConnectionError:
                return time.monotonic() - t0
            if time.monotonic() - t0 > header_timeout + 10:
                break
        return float("inf")
    finally:
        writer.close()


async def parser_refused(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Length: 2\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(4096), 10)
    writer.close()
    return int(reply.split(b" ")[1]) if reply else 0


async def many_empty_messages(s, model: str, t: Tally) -> tuple[float, float, float]:
    """The slowest /health answer (s) in the 3 s before posting 30,000 empty chat messages and while the
    post is processed (the load runs throughout: the first number is the baseline), and the post's time."""
    slowest = [0.0, 0.0]
    phase = 0

    async def ping():
        while True:
            t0 = time.monotonic()
            async with s.get("/health") as r:
                await r.read()
            slowest[phase] = max(slowest[phase], time.monotonic() - t0)
            await asyncio.sleep(0.02)
    task = asyncio.create_task(ping())
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}] * 30_000, "max_tokens": 1})
    try:
        await asyncio.sleep(3.0)
        phase, t0 = 1, time.monotonic()
        async with s.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            t.status("30k_messages", r.status, expected=(400,))
        took = time.monotonic() - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return slowest[0], slowest[1], took


# ---- server state -----------------------------------------------------------------------------------
async def gamma_counts(s) -> dict[str, float]:
    """Decode steps per γ bucket (from the cumulative ``nightjar:spec_gamma`` histogram)."""
    async with s.get("/metrics") as r:
        text = await r.text()
    cum = {m.group(1): float(m.group(2)) for m in re.finditer(r'^nightjar:spec_gamma_bucket\{le="([^"]+)"\} (\S+)$',
                                                                text, re.M)}
    out, prev = {}, 0.0
    for le, c in sorted(cum.items(), key=lambda kv: float(kv[0])):
        out[le] = c - prev
        prev = c
    return {k: v for k, v in out.items() if v}


async def metrics(s) -> dict[str, float]:
    async with s.get("/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(nightjar:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def settle(s, timeout_s: float) -> tuple[float, dict]:
    """Seconds until nothing runs, every block is free and the draft is resident (or the timeout)."""
    t0 = time.monotonic()
    while True:
        m = await metrics(s)
        idle = m.get("nightjar:num_requests_running", 1) == 0 and m.get("nightjar:num_requests_waiting", 1) == 0
        free = m.get("nightjar:kv_blocks_free") == m.get("nightjar:kv_blocks_total")
        if idle and free and m.get("nightjar:draft_resident") == 1:
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout_s:
            return float("inf"), m
        await asyncio.sleep(0.25)


# ---- the soak ----------------------------------------------------------------------------------------
async def soak(a, srv: SubprocessServer) -> dict:
    t = Tally()
    rounds = []
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=a.concurrency + 8)
    async with aiohttp.ClientSession(srv.base_url, timeout=timeout, connector=conn) as s:
        async with s.get("/v1/models") as r:
            card = (await r.json())["data"][0]
        model, context = card["id"], card["max_model_len"]
        start = await metrics(s)
        round_s = a.minutes * 60 / a.rounds
        for i in range(a.rounds):
            t0 = time.monotonic()
            burst_end, round_end = t0 + round_s * a.burst_frac, t0 + round_s
            jobs = [worker(s, a.seed * 1000 + i * 100 + w, burst_end if w else round_end, t, model, context)
                    for w in range(a.concurrency)]
            probes = asyncio.gather(trickled_head(srv.port, a.header_timeout), parser_refused(srv.port),
                                    many_empty_messages(s, model, t))
            *_, (dropped_s, refused_status, health_s) = await asyncio.gather(*jobs, probes)
            settle_s, m = await settle(s, a.settle_timeout)
            await asyncio.sleep(a.idle_s)       # the server trims malloc's free memory once idle (every 5 s)
            rounds.append({
                "round": i + 1, "requests": sum(t.kinds.values()), "settle_s": round(settle_s, 2),
                "blocks_free": m.get("nightjar:kv_blocks_free"), "blocks_total": m.get("nightjar:kv_blocks_total"),
                "draft_resident": m.get("nightjar:draft_resident"),
                "offloads": m.get("nightjar:draft_offloads_total", 0) - start.get("nightjar:draft_offloads_total", 0),
                "reloads": m.get("nightjar:draft_reloads_total", 0) - start.get("nightjar:draft_reloads_total", 0),
                "rss_mib": round(rss_mib(srv.proc.pid), 1), "trickled_head_dropped_after_s": round(dropped_s, 1),
                "parser_refused_status": refused_status,
                "slowest_health_before_30k_messages_s": round(health_s[0], 3),
                "slowest_health_during_30k_messages_s": round(health_s[1], 3),
                "30k_messages_answered_in_s": round(health_s[2], 3),
            })
            print(json.dumps(rounds[-1]), flush=True)
        gammas = await gamma_counts(s)
    return {"tally": t, "rounds": rounds, "model": model, "context": context, "gamma_steps": gammas}


def verdicts(a, res: dict, log_text: str) -> dict[str, bool]:
    t, rounds = res["tally"], res["rounds"]
    rss = [r["rss_mib"] for r in rounds]
    late = rss[len(rss) // 2:] if len(rss) > 2 else rss[-2:]      # warm-up (shapes, offload cycles) first
    return {
        "no 5xx": not any(s >= 500 for s in t.statuses),
        "only the expected statuses": not t.unexpected,
        "no client-side errors": not t.client_errors,
        "no traceback or ERROR line in the server log": "Traceback" not in log_text and " ERROR " not in log_text,
        "every block free after each round": all(r["blocks_free"] == r["blocks_total"] for r in rounds),
        "draft resident again after each round": all(r["draft_resident"] == 1 for r in rounds),
        "the draft was offloaded and reloaded as often": rounds[-1]["offloads"] >= 1
                                                         and rounds[-1]["reloads"] == rounds[-1]["offloads"],
        f"RSS flat over the second half of the rounds (within {a.rss_tolerance_mib} MiB)":
            max(late) - min(late) <= a.rss_tolerance_mib,
        "no answer ends in U+FFFD": t.fffd_endings == 0,
        "trickled heads dropped within the header timeout": all(
            r["trickled_head_dropped_after_s"] <= a.header_timeout + 2 for r in rounds),
        "parser-refused requests answered 400": all(r["parser_refused_status"] == 400 for r in rounds),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst-frac", type=float, default=0.7, help="share of a round at full concurrency")
    p.add_argument("--concurrency", type=int, default=24, help="workers in a round's burst (the tail has one)")
    p.add_argument("--device-memory", default="412000000",
                   help="the engine's budget (default: the bf16 pair's weights with their packed copies, "
                        "and 93 KV blocks)")
    p.add_argument("--policy", default="nightjar")
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--body-timeout", type=float, default=10.0)
    p.add_argument("--server-args", default="", help="more `nightjar serve` flags")
    p.add_argument("--settle-timeout", type=float, default=120.0)
    p.add_argument("--rss-tolerance-mib", type=float, default=64.0)
    p.add_argument("--idle-s", type=float, default=7.0, help="idle seconds after settling before sampling RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="server log file (default: a temp file)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.rounds < 1 or a.concurrency < 1 or not 0 < a.burst_frac <= 1:
        p.error("--minutes > 0, --rounds >= 1, --concurrency >= 1 and 0 < --burst-frac <= 1")
    server_args = ["--device-memory", a.device_memory, "--header-timeout", str(a.header_timeout),
                   "--body-timeout", str(a.body_timeout), *a.server_args.split()]
    t0 = time.monotonic()
    with SubprocessServer(a.policy, server_args, log_path=a.log) as srv:
        print(f"server: {' '.join(srv.command)}\nlog: {srv.log_path}", flush=True)
        res = asyncio.run(soak(a, srv))
    log_text = srv.log_path.read_text(errors="replace")
    checks = verdicts(a, res, log_text)
    t = res["tally"]
    summary = {
        "command": " ".join(sys.argv), "server": " ".join(srv.command), "wall_s": round(time.monotonic() - t0, 1),
        "model": res["model"], "advertised_max_model_len": res["context"], "requests": sum(t.kinds.values()),
        "by_kind": dict(t.kinds), "statuses": {str(k): v for k, v in sorted(t.statuses.items())},
        "cut_streams": t.cut_streams, "japanese_cut_by_max_tokens": t.length_cut_japanese,
        "fffd_endings": t.fffd_endings, "client_errors": dict(t.client_errors), "unexpected": t.unexpected,
        "dropped_client_lines": log_text.count("dropped client"),
        "parser_refused_lines": log_text.count("rejected a malformed request"),
        "decode_steps_by_gamma_bucket": res["gamma_steps"], "rounds": res["rounds"], "checks": checks,
    }
    print(json.dumps(summary, indent=1, ensure_ascii=False))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    failed = [k for k, ok in checks.items() if not ok]
    print("PASS" if not failed else f"FAIL: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
