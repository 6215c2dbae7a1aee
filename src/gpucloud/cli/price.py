"""`gpucloud price …`: the price catalog (set by the admin, read by everyone)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpucloud.cli.common import CliError, OutputFormat, OutputOption, cli_errors, client, emit
from gpucloud.cli.common import table as print_table
from gpucloud.core.billing import PriceClass, PriceOut, Resource

app = typer.Typer(help="Prices per GPU model and class, CPU-only cores and volumes.",
                  no_args_is_help=True)
#: MODEL words that are not GPU models, and the option each needs.
_FLAT = {"cpu": (Resource.CPU, "--per-core-hour"), "volume": (Resource.VOLUME,
                                                              "--per-gib-month")}


def _price(model: str, per_gpu_hour: str | None, per_core_hour: str | None,
           per_gib_month: str | None) -> tuple[Resource, str]:
    """Which resource MODEL names, and the one price option that fits it."""
    resource, option = _FLAT.get(model.lower(), (Resource.GPU, "--per-gpu-hour"))
    given = {"--per-gpu-hour": per_gpu_hour, "--per-core-hour": per_core_hour,
             "--per-gib-month": per_gib_month}
    wrong = [name for name, value in given.items() if value is not None and name != option]
    if wrong:
        raise CliError(f"{wrong[0]} does not fit {model!r}; use {option}")
    value = given[option]
    if value is None:
        raise CliError(f"missing {option} for {model!r}")
    return resource, value


@app.command("set")
def set_price(
    model: Annotated[str, typer.Argument(help="A GPU model (H100-80GB), or cpu, or volume")],
    price_class: Annotated[PriceClass, typer.Option("--class", help="on-demand or spot",
                                                    case_sensitive=False)]
    = PriceClass.ON_DEMAND,
    per_gpu_hour: Annotated[str | None, typer.Option(help="USD per GPU-hour")] = None,
    per_core_hour: Annotated[str | None, typer.Option(
        help="USD per core-hour of CPU-only pods (MODEL cpu)")] = None,
    per_gib_month: Annotated[str | None, typer.Option(
        help="USD per GiB-month of volumes (MODEL volume)")] = None,
    mig: Annotated[str | None, typer.Option(
        help="A MIG profile of the model (1g.10gb): price per instance-hour")] = None,
    effective: Annotated[str | None, typer.Option(
        help="When the price takes effect (ISO 8601, UTC if no zone; default now)")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Set a price from now (or --effective); usage before keeps its old price (admin)."""
    with cli_errors():
        resource, value = _price(model, per_gpu_hour, per_core_hour, per_gib_month)
        body: dict[str, Any] = {"resource": resource.value, "price_class": price_class.value,
                                "price": value}
        if resource is Resource.GPU:
            body["model"] = model
        if mig is not None:
            body["mig_profile"] = mig
        if effective is not None:
            body["effective_at"] = effective
        price = client().set_price(body)
        emit(price, output, lambda: typer.echo(
            f"price of {_name(price)} {price.price_class.value}: ${price.price} per "
            f"{price.unit} from {price.effective_at.isoformat() if price.effective_at else '-'}"))


def _name(price: PriceOut) -> str:
    if price.resource is not Resource.GPU:
        return price.resource.value
    return f"{price.model} MIG {price.mig_profile}" if price.mig_profile else str(price.model)


@app.command("list")
def list_prices(output: OutputOption = OutputFormat.TABLE) -> None:
    """Every price: set versions (with their effective time) and built-in defaults."""
    with cli_errors():
        items = client().list_prices()
        emit(items, output, lambda: print_table(
            ["RESOURCE", "CLASS", "PRICE", "UNIT", "EFFECTIVE", "SOURCE"],
            [[_name(p), p.price_class.value, f"${p.price}", p.unit,
              p.effective_at.isoformat(timespec="seconds") if p.effective_at else "",
              p.source] for p in items]))
