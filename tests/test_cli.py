"""The `nightjar serve` command line: what --help says about the API key, and the client-limit flags."""
from __future__ import annotations

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
