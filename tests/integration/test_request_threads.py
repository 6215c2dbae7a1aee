"""``GPUCLOUD_REQUEST_THREADS`` (``Settings.request_threads``): the API's worker threads
for blocking work, anyio's default limiter, set when the app starts."""

from __future__ import annotations

from dataclasses import replace

import anyio.to_thread
import pytest
from fastapi.testclient import TestClient

from gpucloud.api.app import create_app
from gpucloud.core.settings import DEFAULT_REQUEST_THREADS, Settings


async def _threads() -> float:
    return anyio.to_thread.current_default_thread_limiter().total_tokens


def test_the_apps_worker_threads_are_the_setting(settings: Settings) -> None:
    with TestClient(create_app(replace(settings, request_threads=3))) as client:
        assert client.portal is not None and client.portal.call(_threads) == 3
        assert client.get("/healthz").status_code == 200


def test_unset_is_the_default_not_anyios_40(monkeypatch: pytest.MonkeyPatch,
                                           settings: Settings) -> None:
    monkeypatch.delenv("GPUCLOUD_REQUEST_THREADS", raising=False)
    assert Settings.from_env().request_threads == DEFAULT_REQUEST_THREADS == 10
    with TestClient(create_app(settings)) as client:
        assert client.portal is not None and client.portal.call(_threads) == 10


@pytest.mark.parametrize("raw", ["1", "0", "-3", "many", "2.5", "1001"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                    raw: str) -> None:
    monkeypatch.setenv("GPUCLOUD_REQUEST_THREADS", raw)
    with pytest.raises(ValueError, match="GPUCLOUD_REQUEST_THREADS"):
        Settings.from_env()


def test_a_good_value_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCLOUD_REQUEST_THREADS", "12")
    assert Settings.from_env().request_threads == 12
