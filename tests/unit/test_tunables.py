"""Benchmark knobs from the environment: bad values fall back to the default, logged."""

from __future__ import annotations

import logging

import pytest

from gpucloud.core.tunables import number_from_env


def test_unset_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCLOUD_TEST_KNOB", raising=False)
    assert number_from_env("GPUCLOUD_TEST_KNOB", 100, 1, 1000) == 100


@pytest.mark.parametrize(("raw", "expected"), [("250", 250), ("1", 1), ("1000", 1000)])
def test_a_value_in_range_is_used(monkeypatch: pytest.MonkeyPatch, raw: str,
                                  expected: int) -> None:
    monkeypatch.setenv("GPUCLOUD_TEST_KNOB", raw)
    value = number_from_env("GPUCLOUD_TEST_KNOB", 100, 1, 1000)
    assert value == expected and isinstance(value, int)


@pytest.mark.parametrize("raw", ["0", "1001", "abc", "2.5", "", "nan"])
def test_a_bad_integer_is_logged_and_the_default_used(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str) -> None:
    monkeypatch.setenv("GPUCLOUD_TEST_KNOB", raw)
    with caplog.at_level(logging.WARNING):
        assert number_from_env("GPUCLOUD_TEST_KNOB", 100, 1, 1000) == 100
    assert "GPUCLOUD_TEST_KNOB" in caplog.text


@pytest.mark.parametrize(("raw", "expected"), [("0.5", 0.5), ("0", 0.0), ("nan", 2.0),
                                               ("-1", 2.0), ("x", 2.0)])
def test_floats(monkeypatch: pytest.MonkeyPatch, raw: str, expected: float) -> None:
    monkeypatch.setenv("GPUCLOUD_TEST_KNOB", raw)
    assert number_from_env("GPUCLOUD_TEST_KNOB", 2.0, 0.0, 60.0) == expected
