"""The `nightjar serve` command line: what --help says about the API key, and the client-limit flags."""
from __future__ import annotations

from pathlib import Path

import pytest

from nightjar.cli import build_parser, main


def help_text(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_serve_help_says_the_api_key_flag_is_visible_in_the_process_list_and_names_the_env_variable(capsys):
    text = help_text(capsys)
    assert "process list" in text and "prefer the NIGHTJAR_API_KEY environment variable" in text


def test_serve_client_limits_have_defaults_and_bad_values_exit_2_without_traceback(capsys):
    a = build_parser().parse_args(["serve"])
    assert (a.header_timeout, a.body_timeout, a.max_connections, a.keepalive_timeout) == (10.0, 30.0, 512, 75.0)
    for flag, value in (("--header-timeout", "0"), ("--body-timeout", "-1"), ("--max-connections", "x")):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err


def test_generate_runs_its_forwards_inline_and_serve_on_a_compute_thread_unless_told():
    from nightjar.engine_args import engine_kwargs

    def inline(argv):
        return engine_kwargs(build_parser().parse_args(argv))["inline_compute"]
    assert inline(["generate", "hi"]) and not inline(["generate", "hi", "--no-inline-compute"])
    assert not inline(["serve"]) and inline(["serve", "--inline-compute"])


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--policy", "fixed:5"], "--policy"),
    (["generate", "hi", "--policy", "nosuch"], "--policy"),
    (["generate", "hi", "--gamma-max", "99"], "--gamma-max"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "--model"),
    (["generate", "hi", "--draft", "/no/such/draft"], "--draft"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--block-size", "-4"], "--block-size"),
    (["serve", "--device-memory", "0"], "--device-memory"),
    (["serve", "--draft-tree", "9"], "--draft-tree"),
    (["serve", "--draft-tree-batch", "0"], "--draft-tree-batch"),
    (["generate", "hi", "--draft", "independent", "--draft-tree", "2"], "--draft-tree"),
    (["generate", "hi", "--draft", "ngram:4-2"], "--draft"),
    (["generate", "hi", "--prompt-lookup", "9"], "--prompt-lookup"),
    (["generate", "hi", "--draft", "ngram", "--draft-tree", "2"], "--draft-tree"),
    (["generate", "hi", "--draft", "ngram", "--draft-quantization", "int8"], "--draft-quantization"),
])
def test_bad_engine_flags_exit_2_with_one_line_naming_the_flag(capsys, argv, flag):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"argument {flag}:" in err and "Traceback" not in err


def test_the_module_entry_point_returns_the_exit_code():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "nightjar", "generate", "hi", "--policy", "fixed:9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "fixed:K needs 0 <= K <= gamma_max=4" in r.stderr and "Traceback" not in r.stderr


def test_generate_trace_writes_the_run_to_the_file(tmp_path, capsys, smollm2_path):
    from nightjar.kernel.messages import StepTimed
    from nightjar.kernel.trace import TraceReader

    path = tmp_path / "gen.njtrace"
    assert main(["generate", "hi", "--policy", "off", "--draft", "none", "--dtype", "float32",
                 "--max-tokens", "3", "--json", "--trace", str(path)]) == 0
    steps = [e.msg for e in TraceReader(str(path)) if isinstance(e.msg, StepTimed)]
    assert len(steps) >= 3 and all(s.gamma == 0 for s in steps)


def test_an_engine_with_a_bad_setting_fails_before_loading_anything():
    import asyncio

    from nightjar.engine import Engine
    from nightjar.sampling import ConfigError

    with pytest.raises(ConfigError, match="fixed:K needs") as e:
        asyncio.run(Engine(model="/no/such/model", policy="fixed:7").start())
    assert e.value.field == "policy"


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--gpu", "a100", "--model-shape", "13b", "--policies", "fixed:9", "--num-requests", "20"],
     "fixed:K needs 0 <= K <= gamma_max=4"),
    (["simulate", "--gpu", "nosuch", "--model-shape", "13b"], "unknown GPU 'nosuch'"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2"], "cannot reach http://127.0.0.1:9"),
    (["trace", "summary", "/no/such/trace.njtrace"], "No such file"),
    (["profile", "--quick", "--out", "/no/such/dir/p.json"], "--out /no/such/dir/p.json: no such directory"),
])
def test_offline_subcommand_mistakes_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line or needle in line]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_a_model_or_draft_that_exists_but_does_not_load_exits_2_with_one_line(capsys, tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)                                  # truncated: a header, no tensors
    head = tmp_path / "head"
    head.mkdir()                                                            # a head config without weights
    (head / "head_config.json").write_text(
        (Path(__file__).parent.parent / "nightjar/models/drafts/smollm2-135m-head/head_config.json").read_text())
    for argv, flag, name in ((["--model", str(bad), "--policy", "off"], "--model", "bad.gguf"),
                             (["--draft", str(head), "--policy", "fixed:1"], "--draft", "head")):
        assert main(["generate", "hi", "--dtype", "float32", "--max-tokens", "2", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"argument {flag}: cannot load" in err and name in err, err
