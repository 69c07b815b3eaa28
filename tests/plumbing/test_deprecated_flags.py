"""A renamed flag keeps its old name and the old name's env var for one release, with a
structlog warning (``plumbing/flags.py``; issue #23's words: ``--transfer-timeout-s`` timed one
KV channel operation, not a transfer, and is now ``--kv-channel-timeout-s``)."""

from __future__ import annotations

import argparse

import pytest
from structlog.testing import capture_logs

from plumbing.config import add_worker_flags, worker_config
from plumbing.flags import add_flag


def _parse(argv: list[str]) -> tuple[float, list[dict]]:
    with capture_logs() as logs:
        parser = argparse.ArgumentParser()
        add_worker_flags(parser, "tiny")
        config = worker_config(parser.parse_args(argv))
    return config.kv_channel_timeout_s, [e for e in logs if e["event"] == "flag.deprecated"]


def test_the_new_flag_sets_the_timeout_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_TRANSFER_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SPLITSERVE_KV_CHANNEL_TIMEOUT_S", raising=False)
    assert _parse([]) == (30.0, [])
    assert _parse(["--kv-channel-timeout-s", "7"]) == (7.0, [])


def test_the_old_flag_still_works_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_TRANSFER_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SPLITSERVE_KV_CHANNEL_TIMEOUT_S", raising=False)
    timeout, warnings = _parse(["--transfer-timeout-s", "5"])
    assert timeout == 5.0
    assert [(w["flag"], w["use"], w["log_level"]) for w in warnings] == [
        ("--transfer-timeout-s", "--kv-channel-timeout-s", "warning")]


def test_the_old_env_var_still_works_warns_and_yields_to_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_KV_CHANNEL_TIMEOUT_S", raising=False)
    monkeypatch.setenv("SPLITSERVE_TRANSFER_TIMEOUT_S", "9")
    timeout, warnings = _parse([])
    assert timeout == 9.0
    assert [(w["env"], w["use"]) for w in warnings] == [("SPLITSERVE_TRANSFER_TIMEOUT_S", "SPLITSERVE_KV_CHANNEL_TIMEOUT_S")]
    monkeypatch.setenv("SPLITSERVE_KV_CHANNEL_TIMEOUT_S", "11")
    assert _parse([])[0] == 11.0
    assert _parse(["--kv-channel-timeout-s", "3"])[0] == 3.0  # a flag wins over both


def test_help_names_the_deprecated_alias() -> None:
    parser = argparse.ArgumentParser()
    add_worker_flags(parser, "tiny")
    action = next(a for a in parser._actions if "--transfer-timeout-s" in a.option_strings)
    assert action.option_strings == ["--kv-channel-timeout-s", "--transfer-timeout-s"]
    assert action.help is not None and action.help.endswith("(--transfer-timeout-s: deprecated, removed in the next release)")


def test_only_storing_flags_take_aliases() -> None:
    with pytest.raises(ValueError, match="--quiet"):
        add_flag(argparse.ArgumentParser(), "--quiet", deprecated=("--silent",), action="store_true")
