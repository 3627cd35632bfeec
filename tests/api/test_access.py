"""API keys and the caller's trust, as plain functions; the warning for an open API."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.api.access import KEY_SCOPE, is_trusted, match_key
from pdserve.api.app import warn_if_open
from pdserve.api.config import ApiConfig

KEYS = (b"alpha-key", b"beta-key")


def test_a_key_matches_only_as_a_bearer_token() -> None:
    assert match_key("Bearer beta-key", KEYS) == 1
    assert match_key("bearer alpha-key", KEYS) == 0
    for header in (None, "", "Bearer", "Bearer alpha", "Bearer alpha-key2", "Basic alpha-key", "alpha-key"):
        assert match_key(header, KEYS) is None, header


def test_transfer_endpoints_are_for_key_holders_or_this_machine() -> None:
    assert is_trusted({"client": ("127.0.0.1", 5000)})
    assert is_trusted({"client": ("::1", 5000)})
    assert not is_trusted({"client": ("10.1.2.3", 5000)})
    assert is_trusted({"client": ("10.1.2.3", 5000), KEY_SCOPE: 0})


def test_an_open_api_on_every_interface_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        warn_if_open(ApiConfig("nats://n:1", Path("/m")))  # loopback: quiet
        warn_if_open(ApiConfig("nats://n:1", Path("/m"), host="0.0.0.0", api_keys=("k",)))  # a key: quiet
        assert not caplog.records
        warn_if_open(ApiConfig("nats://n:1", Path("/m"), host="0.0.0.0"))
    assert "every interface" in caplog.records[0].getMessage()


def test_keys_must_be_clean() -> None:
    for bad in ("", " padded "):
        with pytest.raises(ValueError):
            ApiConfig("nats://n:1", Path("/m"), api_keys=(bad,))
