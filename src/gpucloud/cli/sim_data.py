"""``gpucloud sim data …``: where the simulator's traces are, and fetching them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.table import Table

from gpucloud.cli.common import CliError, cli_errors
from gpucloud.core.errors import NotFound
from gpucloud.sim.data import FETCH_COMMAND, dataset_dir, fetched_data_dir
from gpucloud.sim.fetch import dataset_names, fetch, load_manifest, select

app = typer.Typer(help="The simulator's traces: where they are, and fetching them.",
                  no_args_is_help=True)
console = Console()


@app.command("list")
def list_data() -> None:
    """Each trace of the manifest and the folder it is read from (or how to fetch it)."""
    table = Table()
    for column in ("dataset", "files", "MiB", "found in"):
        table.add_column(column)
    files = load_manifest()
    for name in dataset_names(files):
        mine = select(files, [name])
        try:
            where = str(dataset_dir(name))
        except NotFound:
            where = f"missing: {FETCH_COMMAND} {name}"
        table.add_row(name, str(len(mine)), f"{sum(f.size for f in mine) / 2**20:.1f}", where)
    console.print(table)


@app.command("fetch")
def fetch_data(
    datasets: Annotated[list[str] | None, typer.Argument(
        help="Datasets to fetch (default: all; see `gpucloud sim data list`)")] = None,
    mirror: Annotated[str | None, typer.Option(
        help="Base URL of a copy of the data folder, instead of the upstream URLs",
        envvar="GPUCLOUD_DATA_MIRROR")] = None,
    dest: Annotated[Path | None, typer.Option(
        help="Folder to fetch into (default: $GPUCLOUD_HOME/data)")] = None,
) -> None:
    """Download the traces from their upstream repositories, checked against the sha256
    pinned in the manifest shipped with gpucloud."""
    with cli_errors():
        target = dest or fetched_data_dir()
        files = select(load_manifest(), datasets or [])
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("fetching", total=sum(f.size for f in files))
            results = fetch(target, datasets or [], mirror=mirror,
                            progress=lambda n: progress.advance(task, n))
        fetched = [r for r in results if r.action != "present"]
        if not results:
            raise CliError("nothing to fetch")
        console.print(f"{len(fetched)} file(s) fetched, {len(results) - len(fetched)} already "
                      f"present, in {target}")
