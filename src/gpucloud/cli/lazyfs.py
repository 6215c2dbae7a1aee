"""``gpucloud lazyfs``: the node's FUSE daemon for lazily pulled eStargz layers.

The agent starts it itself (in a session of its own) when the node has ``/dev/fuse``; run
it by hand only to debug. See ``gpucloud.images.lazy.daemon``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.images.lazy import daemon


def lazyfs(
    state_dir: Annotated[Path, typer.Option(help="The agent's state directory")],
    cache_limit: Annotated[int, typer.Option(help="Chunk cache size limit in bytes")] = (
        daemon.DEFAULT_CACHE_LIMIT),
    read_deadline: Annotated[float, typer.Option(
        help="Seconds a read may wait for the registry before it gets EIO")] = 30.0,
) -> None:
    """Serve lazily mounted layers for this node until stopped."""
    try:
        daemon.main(["--state-dir", str(state_dir), "--cache-limit", str(cache_limit),
                     "--read-deadline", str(read_deadline)])
    except KeyboardInterrupt:
        pass
