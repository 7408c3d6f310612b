"""The ``admin`` and ``tracing`` config sections: debug endpoints never open without a token."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config

TOKEN = "s3cret-admin-token-0123"


def test_defaults_keep_debug_and_tracing_off() -> None:
    cfg = load_config(None)
    assert cfg.admin.debug is False and cfg.admin.bearer_token() is None
    assert cfg.tracing.enabled is False and cfg.admin.decision_log_size == 256


def test_debug_without_a_token_fails_at_start() -> None:
    with pytest.raises(ConfigError, match=r"admin: .*bearer token"):
        load_config(None, admin={"debug": True})


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        load_config(None, admin={"debug": True, "token": "short"})


def test_token_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN__DEBUG", "true")
    monkeypatch.setenv("KVGATE_ADMIN__TOKEN", TOKEN)
    cfg = load_config(None)
    assert cfg.admin.debug and cfg.admin.bearer_token() == TOKEN
    assert TOKEN not in repr(cfg)  # a secret never shows in logs or error messages


def test_token_from_a_file(tmp_path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    cfg = load_config(None, admin={"debug": True, "token_file": str(path)})
    assert cfg.admin.bearer_token() == TOKEN
    with pytest.raises(ConfigError, match="not found|No such file"):
        load_config(None, admin={"debug": True, "token_file": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(None, admin={"debug": True, "token_file": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, admin={"debug": True, "token": TOKEN, "token_file": str(path)})


def test_unknown_fields_and_bad_sizes_are_named() -> None:
    with pytest.raises(ConfigError, match=r"admin\.debg: unknown field"):
        load_config(None, admin={"debg": True})
    with pytest.raises(ConfigError, match=r"admin\.decision_log_size"):
        load_config(None, admin={"decision_log_size": 0})
    with pytest.raises(ConfigError, match=r"tracing\.enable: unknown field"):
        load_config(None, tracing={"enable": True})
