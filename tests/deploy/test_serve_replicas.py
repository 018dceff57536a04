"""Nightjar on Ray Serve, for real: a local Ray (2 CPUs), two engine replicas of the tiny pair behind the
ingress, driven over HTTP by the official ``openai`` client and by the malformed-request table.

One module-scoped cluster (Ray start + deploy take ~30-40 s on the 2-core box); the kill test runs last.
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import socket
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

from nightjar.deploy.cluster import APP_NAME, ClusterOptions, start  # noqa: E402
from nightjar.deploy.serve_app import REPLICA_HEADER  # noqa: E402
from nightjar.models import LoadedModel  # noqa: E402
from tests.api.api_support import API_KEY, MODEL  # noqa: E402
from tests.api.test_malformed_requests import CASES, CHAT, LIMIT, chat  # noqa: E402
from tests.conftest import perturbed, random_model, tiny_config  # noqa: E402

MSG = [{"role": "user", "content": "hi"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(smol_tokenizer):
    """Two replicas with 1 CPU each, the engine settings of the malformed-request suite's server, on a
    fresh copy of the tiny pair (what is shipped to the replicas is pickled: nothing other tests did to the
    session's pair travels with it)."""
    cfg = tiny_config(eos=smol_tokenizer.eos_token_ids)
    target = random_model(cfg, seed=1)
    tiny_pair = (LoadedModel(target, smol_tokenizer, "tiny"),
                 LoadedModel(perturbed(target, 0.02, 2), None, "tiny-draft"))
    port = _free_port()
    opts = ClusterOptions(num_replicas=2, replica_cpus=1, port=port, api_key=API_KEY, max_body_bytes=LIMIT)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = start(dict(policy="off", loaded=tiny_pair, dtype="float32", num_blocks=64, max_model_len=256),
                    MODEL, opts)
        yield url, port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client, stream: bool, max_tokens: int = 8):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=max_tokens,
                                                           stream=stream, temperature=0)
    replica = raw.headers[REPLICA_HEADER]
    if not stream:
        c = raw.parse()
        return replica, c.choices[0].message.content, c.choices[0].finish_reason
    text, finish = "", None
    for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return replica, text, finish


def test_two_replicas_answer_the_openai_client_streaming_and_not_and_share_the_load(client):
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _chat(client, stream=bool(i % 2)), range(16)))
    assert all(finish == "length" and text for _, text, finish in got), got
    streamed = {text for i, (_, text, _) in enumerate(got) if i % 2}
    plain = {text for i, (_, text, _) in enumerate(got) if not i % 2}
    assert streamed == plain and len(plain) == 1      # greedy, same weights: every replica says the same
    assert len({replica for replica, _, _ in got}) == 2, got
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def _request(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"null")
    finally:
        conn.close()


@pytest.mark.parametrize("name,target,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_the_malformed_request_suite_gets_the_same_status_through_the_cluster(cluster, name, target, body,
                                                                              headers, status, param):
    method, _, path = target.rpartition(" ")
    hdrs = {k: v for k, v in {"Authorization": f"Bearer {API_KEY}", **headers}.items() if v}
    hdrs.setdefault("Content-Type", "application/json")
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    got, resp_headers, payload = _request(cluster[1], method or "POST", path, data, hdrs)
    assert got == status, payload
    assert resp_headers.get("content-type", "").startswith("application/json")
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert resp_headers.get("www-authenticate") == "Bearer"


def test_a_chunked_body_over_the_limit_gets_413_through_the_cluster(cluster):
    conn = http.client.HTTPConnection("127.0.0.1", cluster[1], timeout=60)
    try:
        conn.request("POST", CHAT, body=(b" " * 1024 for _ in range(LIMIT // 1024 + 8)), encode_chunked=True,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    status, _, body = _request(cluster[1], "POST", CHAT, json.dumps(chat(max_tokens=3)).encode(),
                               {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_metrics_are_each_replicas_own_labelled_by_replica(client, cluster):
    from nightjar.bench.metrics import parse_prometheus

    replicas: set[str] = set()
    for sent in range(1, 41):                        # idle routing may send several in a row to one replica
        replicas.add(_chat(client, False)[0])
        if len(replicas) == 2 and sent >= 8:
            break
    deadline, flat = time.monotonic() + 20, {}
    while time.monotonic() < deadline:               # replicas push their exposition every 2 s, so the first
        with urllib.request.urlopen(cluster[0] + "/metrics", timeout=10) as r:    # may predate the last answers
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            flat = parse_prometheus(r.read().decode())
        labelled = {k for k in flat if k.startswith("nightjar:num_requests_running{")}
        done = [v for k, v in flat.items() if k.startswith("nightjar:request_success_total{")]
        if len(labelled) == 2 and sum(done) >= sent:
            break
        time.sleep(1)
    assert labelled == {f'nightjar:num_requests_running{{replica="{r}"}}' for r in replicas} and len(replicas) == 2
    assert sum(done) >= 8


def _stream_until_killed(client, started: cf.Future | None):
    """Stream a long answer; report the replica once the first content arrives. Returns (replica, outcome)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    replica, chunks = raw.headers[REPLICA_HEADER], 0
    try:
        for chunk in raw.parse():
            chunks += 1
            if started is not None and chunks == 2:
                started.set_result(replica)
            if chunk.choices and chunk.choices[0].finish_reason:
                return replica, chunk.choices[0].finish_reason
        return replica, "ended without finish_reason"
    except openai.APIError as e:
        return replica, f"error: {e}"


def test_a_replica_killed_mid_stream_fails_its_stream_the_others_finish_and_it_comes_back(client, cluster):
    before: set[str] = set()
    for _ in range(40):                              # idle routing may send several in a row to one replica
        before.add(_chat(client, False)[0])
        if len(before) == 2:
            break
    assert len(before) == 2
    with cf.ThreadPoolExecutor(6) as pool:
        started = cf.Future()
        victim_stream = pool.submit(_stream_until_killed, client, started)
        victim = started.result(timeout=60)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#NightjarEngine#{victim}", namespace="serve"),
                 no_restart=True)
        t_kill = time.monotonic()
        others = [pool.submit(_chat, client, True, 100) for _ in range(4)]
        replica, outcome = victim_stream.result(timeout=60)
        assert time.monotonic() - t_kill < 30                  # ended, never hung
        results = [f.result(timeout=120) for f in others]
    assert replica == victim
    assert outcome.startswith("error:") and "replica" in outcome, outcome
    assert all(finish == "length" for _, _, finish in results), results
    assert all(r != victim for r, _, _ in results)
    deadline = time.monotonic() + 120                         # Serve replaces the dead replica
    seen: set[str] = set()
    while time.monotonic() < deadline and len(seen - {victim}) < 2:
        seen |= {_chat(client, False)[0]}
        if len(seen - {victim}) < 2:
            time.sleep(0.5)
    assert len(seen - before) >= 1 and victim not in seen, (before, seen)
