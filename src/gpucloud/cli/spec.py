"""The container spec's command-line options, declared once for `pod create`, `job create`
and `template create`.

``@spec_options(*SPEC, *GPUS_PORTS)`` adds the options to a Typer command and hands it
``spec``: the request fields the user gave, and only those. Nothing is filled in from a
default, so a pod created from a template keeps every template value the command line
does not name (the server reads ``model_fields_set``; the SDK sends set fields only).

``--entrypoint`` is one string split like a shell would (``--entrypoint "python -u"``);
``--entrypoint ""`` runs the command with no entrypoint at all.
"""

from __future__ import annotations

import functools
import inspect
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, get_type_hints

import typer
from pydantic import BaseModel, ValidationError

from gpucloud.cli.common import CliError, cli_errors, parse_env, validation_message

Request = TypeVar("Request", bound=BaseModel)
#: The request fields given on the command line.
SpecValues = dict[str, Any]


@dataclass(frozen=True)
class SpecOption:
    """One option: its parameter (Typer derives ``--param-name``), its Typer declaration,
    the request field it sets and how its text becomes that field's value."""

    param: str
    annotation: Any
    field: str
    convert: Callable[[Any], Any] = lambda value: value


def _option(kind: Any, help_text: str) -> Any:
    return Annotated[kind, typer.Option(help=help_text)]


COMMAND = SpecOption("command", Annotated[list[str] | None, typer.Argument(
    help="Command and args, after --")], "command")
IMAGE = SpecOption("image", _option(str | None, "Container image reference"), "image")
GPU_TYPE = SpecOption("gpu_type", _option(str | None, "GPU model, e.g. H100-80GB"), "gpu_type")
CPU = SpecOption("cpu", _option(str | None, "CPU cores: 2, 0.5 or 500m (default 1)"), "cpu")
MEMORY = SpecOption("memory", _option(str | None, "Memory: 512Mi, 16Gi … (default 1Gi)"),
                    "memory")
ENV = SpecOption("env", _option(list[str] | None, "KEY=VALUE, repeatable"), "env", parse_env)
ENTRYPOINT = SpecOption("entrypoint", _option(
    str | None, "Replace the image's entrypoint: one string, split like a shell "
    "(\"python -u\"); \"\" for none"), "entrypoint", shlex.split)
VOLUME_SIZE = SpecOption("volume_size", _option(
    str | None, "Volume disk kept across stop/start: 20Gi"), "volume_size")
VOLUME_PATH = SpecOption("volume_path", _option(
    str | None, "Where the volume disk is mounted (/workspace)"), "volume_path")
CONTAINER_DISK = SpecOption("container_disk", _option(
    str | None, "The container's writable layer, wiped on stop: 10Gi"), "container_disk")
NETWORK_VOLUME = SpecOption("network_volume", _option(
    list[str] | None, "NAME[:/path] of a network volume, repeatable"), "network_volumes")
REGISTRY_AUTH = SpecOption("registry_auth", _option(
    str | None, "Registry credentials to pull the image with (gpucloud registry-auth)"),
    "registry_auth")
CHECKPOINT_DIR = SpecOption("checkpoint_dir", _option(
    str | None, "A directory the platform keeps: committed checkpoints are restored there "
    "on the next start (/ckpt)"), "checkpoint_dir")
CHECKPOINT_SIGNAL = SpecOption("checkpoint_signal", _option(
    str | None, "The checkpoint request sent every interval (default SIGUSR1)"),
    "checkpoint_signal")
CHECKPOINT = SpecOption("checkpoint", _option(
    str | None, "directory (the program writes its checkpoint dir) or transparent "
    "(runc/CRIU dumps the container, where a node can)"), "checkpoint")
MIG = SpecOption("mig", _option(
    str | None, "One MIG instance of this profile of the GPU model: 1g.10gb, 3g.40gb, "
    "7g.80gb …"), "mig")
GPUS = SpecOption("gpus", _option(float | None, "Whole GPUs, or a share below 1 (0.5)"),
                  "gpus")
PORT = SpecOption("port", _option(list[str] | None, "PORT, PORT/http or PORT/tcp; repeatable"),
                  "ports")
SPOT = SpecOption("spot", _option(
    bool | None, "Spot work: the spot priority class, preempted with notice and requeued "
    "elsewhere"), "spot")
BID = SpecOption("bid", _option(float | None, "A spot price per GPU-hour (recorded)"), "bid")
GRACE = SpecOption("grace", _option(
    float | None, "Seconds from a preemption notice (SIGTERM) to SIGKILL (default 30)"),
    "grace")
PRIORITY_CLASS = SpecOption("priority_class", _option(
    str | None, "spot, batch (default), on-demand or another class"), "priority_class")
MAX_DURATION = SpecOption("max_duration", _option(
    str | None, "Stop it after this long (90, 30m, 2h); lets it backfill"), "max_duration")

#: What every container spec has (pods, job members, templates).
SPEC = (COMMAND, IMAGE, GPU_TYPE, CPU, MEMORY, ENV, ENTRYPOINT, VOLUME_SIZE, VOLUME_PATH,
        CONTAINER_DISK, NETWORK_VOLUME, REGISTRY_AUTH, CHECKPOINT_DIR, CHECKPOINT_SIGNAL,
        CHECKPOINT, SPOT, BID, GRACE, MIG)
#: A pod's (and a template's) GPUs and ports; a job has ``--gpus-per-node`` instead.
GPUS_PORTS = (GPUS, PORT)
#: How the scheduler treats running work (pods and jobs).
SCHEDULING = (PRIORITY_CLASS, MAX_DURATION)


def given(options: tuple[SpecOption, ...], values: dict[str, Any]) -> SpecValues:
    """The request fields of the options that were given (an empty repeatable is not)."""
    return {option.field: option.convert(values[option.param]) for option in options
            if values.get(option.param) not in (None, [])}


def spec_options(*options: SpecOption) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add ``options`` to a Typer command that takes ``spec: SpecValues`` (keyword-only)."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        hints = get_type_hints(command, include_extras=True)
        own = [parameter.replace(annotation=hints[parameter.name])
               for parameter in inspect.signature(command).parameters.values()
               if parameter.name != "spec"]
        added = [inspect.Parameter(option.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=option.annotation) for option in options]

        @functools.wraps(command)
        def wrapper(**values: Any) -> None:
            with cli_errors():
                spec = given(options, values)
            command(**{k: v for k, v in values.items() if k not in
                       {option.param for option in options}}, spec=spec)

        parameters = own + added
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return decorate


def build_request(kind: type[Request], body: dict[str, Any]) -> Request:
    """Validate a request here, so a bad value is one line before anything is sent."""
    try:
        return kind.model_validate(body)
    except ValidationError as error:
        raise CliError(validation_message(error)) from None
