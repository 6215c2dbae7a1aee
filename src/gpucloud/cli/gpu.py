"""`gpucloud gpu …`: the hardware profiles for simulated nodes, and what this host has."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpucloud.core.errors import GpucloudError
from gpucloud.core.quantities import format_memory
from gpucloud.gpu.discovery import discover
from gpucloud.gpu.profiles import HardwareProfile, list_profiles

app = typer.Typer(
    help="GPU hardware: simulated profiles and local discovery.", no_args_is_help=True
)


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


OutputOption = Annotated[
    OutputFormat, typer.Option("--output", "-o", help="table or json", case_sensitive=False)
]


def _profile_dict(profile: HardwareProfile) -> dict[str, object]:
    return {
        "name": profile.name,
        "description": profile.description,
        "gpu_model": profile.gpu_model,
        "gpus": profile.gpu_count,
        "numa_nodes": profile.numa_node_count,
        "nvlink_domains": [list(domain) for domain in profile.nvlink_domains],
        "pcie_switches": [list(group) for group in profile.pcie_switches],
        "cpu_cores": profile.cpu_cores,
        "memory_bytes": profile.memory_bytes,
    }


@app.command("profiles")
def profiles(output: OutputOption = OutputFormat.table) -> None:
    """List the built-in hardware profiles usable with `gpucloud agent --simulate`."""
    if output is OutputFormat.json:
        typer.echo(json.dumps([_profile_dict(p) for p in list_profiles()], indent=2))
        return
    table = Table("NAME", "GPUS", "CPUS", "MEMORY", "DESCRIPTION")
    for profile in list_profiles():
        table.add_row(
            profile.name,
            f"{profile.gpu_count}x {profile.gpu_model}",
            str(profile.cpu_cores),
            format_memory(profile.memory_bytes),
            profile.description,
        )
    Console().print(table)


@app.command("discover")
def discover_command(
    simulate: Annotated[str | None, typer.Option(help="a hardware profile to simulate")] = None,
    name: Annotated[str, typer.Option(help="node name (seeds simulated GPU UUIDs)")] = "local",
    output: OutputOption = OutputFormat.table,
) -> None:
    """Show the hardware an agent on this host would register."""
    try:
        hardware = discover(simulate, name)
    except GpucloudError as error:
        typer.echo(f"error: {error.message}", err=True)
        raise typer.Exit(2) from None
    if output is OutputFormat.json:
        typer.echo(hardware.model_dump_json(indent=2))
        return
    console = Console()
    console.print(
        f"provider: {hardware.provider}  cpus: {hardware.cpu_cores}  "
        f"memory: {format_memory(hardware.memory_bytes)}  driver: {hardware.driver_version or '-'}"
    )
    if hardware.note:
        console.print(hardware.note)
    table = Table("INDEX", "UUID", "MODEL", "MEMORY", "NUMA", "NVLINK PEERS", "PCI", "MIG")
    for gpu in hardware.gpus:
        table.add_row(
            str(gpu.index), gpu.uuid, gpu.model, f"{gpu.memory_mib} MiB",
            "-" if gpu.numa_node is None else str(gpu.numa_node),
            ",".join(map(str, gpu.nvlink_peers)) or "-", gpu.pci_bus_id or "-",
            "on" if gpu.mig_mode else ("off" if gpu.mig_capable else "-"),
        )
    if hardware.gpus:
        console.print(table)
