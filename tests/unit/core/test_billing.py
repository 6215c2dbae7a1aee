"""Money, months, MIG shares and the pricing of runs: exact, table-driven."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gpucloud.core.billing import PriceClass, Resource, mig_slices, parse_money, parse_month
from gpucloud.services.charges import cost_of, pieces
from gpucloud.services.prices import PriceBook

T0 = datetime(2026, 12, 31, 23, 59, 50, tzinfo=UTC)


@dataclass(frozen=True)
class Run:
    pod_id: str = "p"
    job_id: str | None = None
    gpu_type: str | None = "H100-80GB"
    gpus: float = 2
    gpu_milli: int = 2000
    mig_profile: str | None = None
    cpu_milli: int = 4000
    volume_bytes: int | None = 0
    spot: bool = False
    started_at: datetime = T0
    ended_at: datetime | None = T0 + timedelta(seconds=20)
    credited: bool = False


@pytest.mark.parametrize(("text", "amount"), [("3.60", Decimal("3.6")), (3.6, Decimal("3.6")),
                                              ("0", Decimal(0)), (2, Decimal(2)),
                                              (" 0.000001 ", Decimal("0.000001"))])
def test_money_parses_exactly(text: object, amount: Decimal) -> None:
    assert parse_money(text) == amount


@pytest.mark.parametrize("text", ["-1", "abc", "NaN", "inf", "1e9", "0.0000001", True, None])
def test_bad_money_is_refused(text: object) -> None:
    with pytest.raises(ValueError):
        parse_money(text)


def test_months_parse_to_utc_bounds() -> None:
    assert parse_month("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC),
                                      datetime(2027, 1, 1, tzinfo=UTC))
    for bad in ("2026-13", "2026-00", "26-01", "2026-1", "1969-12"):
        with pytest.raises(ValueError):
            parse_month(bad)


def test_mig_profiles_count_compute_slices() -> None:
    assert [mig_slices(p) for p in ("1g.10gb", "3g.40gb", "7g.80gb")] == [1, 3, 7]
    with pytest.raises(ValueError):
        mig_slices("8g.90gb")


def _book(price: str = "3.60", since: datetime = T0 - timedelta(days=1)) -> PriceBook:
    return PriceBook({("gpu", "H100-80GB", "", "on-demand"): [(since, Decimal(price))]})


def test_whole_gpus_cost_gpus_times_seconds_at_the_price() -> None:
    assert cost_of(_book(), [Run()], T0, T0 + timedelta(hours=1)) == Decimal("0.04")


def test_a_run_is_split_at_midnight_and_at_a_price_change() -> None:
    change = T0 + timedelta(seconds=15)
    book = _book()
    book.versions[("gpu", "H100-80GB", "", "on-demand")].append((change, Decimal("7.20")))
    parts = pieces(book, [Run()], T0, T0 + timedelta(hours=1))
    assert [(p.start.second, p.end.second, p.charges[0].unit_price) for p in parts] == [
        (50, 0, Decimal("3.60")), (0, 5, Decimal("3.60")), (5, 10, Decimal("7.20"))]
    # 2 GPUs: 15 s at $3.60/h and 5 s at $7.20/h
    assert cost_of(book, [Run()], T0, T0 + timedelta(hours=1)) == Decimal("0.05")


def test_clipping_to_the_period_and_open_runs() -> None:
    until = T0 + timedelta(seconds=5)
    assert cost_of(_book(), [Run(ended_at=None)], T0, until) == Decimal("0.01")
    assert cost_of(_book(), [Run()], T0 + timedelta(seconds=30), T0 + timedelta(hours=1)) == 0


def test_shares_mig_cpu_volume_spot_and_credits() -> None:
    hour = T0 + timedelta(hours=1)
    book = _book()
    assert cost_of(book, [Run(gpus=0.5, gpu_milli=500, ended_at=hour)], T0, hour) == Decimal("1.8")
    # 3g.40gb: 3/7 of the GPU price, per instance
    assert cost_of(book, [Run(gpus=1, gpu_milli=0, mig_profile="3g.40gb", ended_at=hour)], T0,
                   hour) == Decimal("1.542857")
    assert cost_of(book, [Run(gpus=0, gpu_milli=0, gpu_type=None, ended_at=hour)], T0,
                   hour) == Decimal("0.12")  # 4 cores × default $0.03
    assert cost_of(book, [Run(spot=True, ended_at=hour)], T0, hour) == Decimal("3.58")  # 2 × 1.79
    gib_month = Run(gpus=0, gpu_milli=0, cpu_milli=0, volume_bytes=30 << 30,
                    ended_at=T0 + timedelta(days=1))
    assert cost_of(book, [gib_month], T0, T0 + timedelta(days=2)) == Decimal("0.07")
    assert cost_of(book, [Run(credited=True)], T0, hour) == 0


def test_defaults_apply_before_the_first_set_version() -> None:
    book = _book(since=T0 + timedelta(seconds=10))
    parts = pieces(book, [Run()], T0, T0 + timedelta(hours=1))
    assert [c.unit_price for p in parts for c in p.charges] == [Decimal("2.99"),
                                                                 Decimal("3.60")]
    assert {c.resource for p in parts for c in p.charges} == {Resource.GPU}
    assert {c.price_class for p in parts for c in p.charges} == {PriceClass.ON_DEMAND}
