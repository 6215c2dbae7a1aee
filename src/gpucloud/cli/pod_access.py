"""`gpucloud pod exec` and `gpucloud pod ssh` (registered on the `pod` app)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from types import FrameType
from typing import Annotated

import typer
from websockets.sync.client import ClientConnection

from gpucloud.cli.common import CliError, api_key, cli_errors, client, server_url
from gpucloud.client.exec import ExecRequest, run_exec, send_resize


@contextlib.contextmanager
def _raw_terminal(enabled: bool) -> Iterator[None]:
    """The local terminal in raw mode while a TTY exec runs (keys go to the pod as typed)."""
    if not enabled or not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _follow_resizes(ws: ClientConnection) -> None:
    """Send the local terminal's size to the pod whenever it changes (SIGWINCH)."""

    def resized(_signum: int, _frame: FrameType | None) -> None:
        size = shutil.get_terminal_size()
        send_resize(ws, size.columns, size.lines)

    signal.signal(signal.SIGWINCH, resized)


def exec_(
    pod: Annotated[str, typer.Argument(help="Pod id or name")],
    command: Annotated[list[str], typer.Argument(help="Command and args, after --")],
    interactive: Annotated[bool, typer.Option("--interactive", "-i",
                                              help="Pass stdin to the command")] = False,
    tty_: Annotated[bool, typer.Option("--tty", "-t", help="Allocate a terminal")] = False,
) -> None:
    """Run a command in a running pod: gpucloud pod exec POD [-i] [-t] -- CMD [ARGS...]

    Exits with the command's exit code."""
    with cli_errors():
        if not command:
            raise CliError("give the command after --")
        size = shutil.get_terminal_size()
        request = ExecRequest(command=list(command), tty=tty_, cols=size.columns,
                              rows=size.lines,
                              env={"TERM": os.environ.get("TERM", "xterm")} if tty_ else {})
        with _raw_terminal(tty_ and interactive):
            code = run_exec(server_url(), api_key(), pod, request,
                            sys.stdin.buffer if interactive else None, sys.stdout.buffer,
                            sys.stderr.buffer, on_open=_follow_resizes if tty_ else None)
    raise typer.Exit(code)


def ssh(
    pod: Annotated[str, typer.Argument(help="Pod id or name")],
    args: Annotated[list[str] | None, typer.Argument(
        help="More ssh arguments or a remote command, after --")] = None,
    print_: Annotated[bool, typer.Option("--print", help="Print the ssh command only")] = False,
) -> None:
    """SSH into a pod through the server's gateway (runs `ssh -p PORT POD_ID@HOST`)."""
    with cli_errors():
        access = client().pod_access(pod)
        if not access.ssh_port:
            raise CliError("the server runs no SSH gateway (start it with --ssh-port)")
        argv = ["ssh", "-p", str(access.ssh_port), f"{access.ssh_user}@{access.ssh_host}",
                *(args or [])]
        if print_:
            typer.echo(shlex.join(argv))
            return
        if shutil.which("ssh") is None:
            raise CliError("ssh is not installed (Debian: apt install openssh-client)")
    os.execvp("ssh", argv)
