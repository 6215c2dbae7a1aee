"""``services.gpu_milli``: a ``gpu_milli`` column read as its JSON text."""

from __future__ import annotations

from gpucloud.services import gpu_milli


def test_pairs_parse_the_text_once_per_value_and_read_nulls_as_nothing() -> None:
    assert gpu_milli.pairs('{"0": 1000, "3": 500}') == (("0", 1000), ("3", 500))
    assert gpu_milli.pairs(None) == () and gpu_milli.pairs("null") == ()
    assert gpu_milli.pairs("{}") == ()
    before = gpu_milli.pairs.cache_info().hits
    gpu_milli.pairs('{"0": 1000, "3": 500}')
    assert gpu_milli.pairs.cache_info().hits == before + 1
