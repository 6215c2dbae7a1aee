"""What every CLI module shares: config, the client, output as table or JSON, errors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from gpucloud.client import GpucloudClient
from gpucloud.core.errors import GpucloudError
from gpucloud.core.settings import gpucloud_home

DEFAULT_URL = "http://127.0.0.1:8080"
#: How often ``logs --follow`` (pods and jobs) asks for new output.
FOLLOW_POLL_SECONDS = 1.0
#: How event times are shown (``pod events``, ``job events``).
EVENT_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
console = Console()
Item = TypeVar("Item", bound=BaseModel)


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


OutputOption = Annotated[
    OutputFormat, typer.Option("--output", "-o", help="table or json", case_sensitive=False)
]


class CliError(GpucloudError):
    """A problem the CLI reports itself (bad arguments, missing configuration)."""


def config_path() -> Path:
    return gpucloud_home() / "config.json"


def load_config() -> dict[str, str]:
    path = config_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CliError(f"cannot read {path}: {error}") from None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def save_config(values: dict[str, str]) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**load_config(), **values}
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(merged, handle, indent=2)
    tmp.replace(path)
    return path


def _admin_key_file() -> str | None:
    path = gpucloud_home() / "admin.key"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def server_url() -> str:
    return os.environ.get("GPUCLOUD_URL") or load_config().get("url") or DEFAULT_URL


def api_key() -> str | None:
    """GPUCLOUD_API_KEY, else the config file, else a local server's admin.key."""
    return os.environ.get("GPUCLOUD_API_KEY") or load_config().get("api_key") or _admin_key_file()


def client() -> GpucloudClient:
    return GpucloudClient(server_url(), api_key())


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn every expected error into one line on stderr and exit status 1."""
    try:
        yield
    except GpucloudError as error:
        typer.echo(f"error: {error.message}", err=True)
        raise typer.Exit(1) from None


def emit(data: BaseModel | Sequence[BaseModel] | dict[str, Any], output: OutputFormat,
         render: Callable[[], None]) -> None:
    """Print JSON (``--output json``) or call ``render`` for the human form."""
    if output is OutputFormat.JSON:
        if isinstance(data, BaseModel):
            payload: Any = data.model_dump(mode="json")
        elif isinstance(data, dict):
            payload = data
        else:
            payload = [item.model_dump(mode="json") for item in data]
        typer.echo(json.dumps(payload, indent=2))
    else:
        render()


def emit_table(items: Sequence[Item], output: OutputFormat, columns: Sequence[str],
               row: Callable[[Item], Sequence[Any]]) -> None:
    """A list command's answer: the items as JSON, or a table of one ``row(item)`` each."""
    emit(items, output, lambda: table(columns, [row(item) for item in items]))


def emit_deleted(noun: str, ref: str, output: OutputFormat, verb: str = "deleted") -> None:
    """A delete command's answer: ``{"deleted": ref}`` as JSON, or ``<noun> <ref> deleted``."""
    emit({verb: ref}, output, lambda: typer.echo(f"{noun} {ref} {verb}"))


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    grid = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:
        grid.add_column(column)
    for row in rows:
        grid.add_row(*["-" if v is None or v == "" else str(v) for v in row])
    console.print(grid)


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        shown = "-" if value is None or value == "" or value == [] or value == {} else value
        typer.echo(f"{key + ':':<{width + 1}} {shown}")


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CliError(f"--env: {pair!r} is not KEY=VALUE")
        env[key] = value
    return env


def validation_message(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "request"
    return f"{field}: {str(first['msg']).removeprefix('Value error, ')}"
