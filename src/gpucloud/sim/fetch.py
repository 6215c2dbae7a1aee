"""``gpucloud sim data fetch``: the simulator's traces from their upstream repositories.

A fresh clone has no ``../shared/data``. The manifest shipped in the package
(``data_manifest.json``) names every file of every trace, the upstream URL it comes from
(pinned to a commit, so the bytes cannot change under us) and its size and sha256. Files
are downloaded into ``$GPUCLOUD_HOME/data/<dataset>/…``, checked, and only then moved into
place (a temp file and ``os.replace``): an interrupted or corrupted download leaves
nothing half-written, and a rerun skips the files already there and intact. A file made
from others (the PAI machine list with its header) is rebuilt from them and checked the
same way.

``mirror`` replaces every upstream URL by ``<mirror>/<path>`` (a copy of the folder layout
on any HTTP server: the tests serve one on loopback; also useful behind a firewall).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

import httpx

from gpucloud.core.errors import GpucloudError, InvalidInput

MANIFEST_NAME = "data_manifest.json"
CHUNK = 1 << 16
TIMEOUT_SECONDS = 60.0


class FetchError(GpucloudError):
    """A file could not be downloaded, or its bytes are not the pinned ones."""


@dataclass(frozen=True)
class ManifestFile:
    path: str  #: relative to the data folder: ``<dataset>/…``
    size: int
    sha256: str
    url: str | None = None
    #: made from other files: ``{"concat": [paths…], "tar_member": [archive path, member]}``
    derive: dict[str, list[str]] | None = None

    @property
    def dataset(self) -> str:
        return self.path.split("/", 1)[0]


def load_manifest(text: str | None = None) -> list[ManifestFile]:
    """The files of the shipped manifest (or of ``text``, a manifest's JSON)."""
    if text is None:
        text = resources.files("gpucloud.sim").joinpath(MANIFEST_NAME).read_text()
    data: dict[str, Any] = json.loads(text)
    return [ManifestFile(path=f["path"], size=int(f["bytes"]), sha256=f["sha256"],
                         url=f.get("url"), derive=f.get("derive")) for f in data["files"]]


def dataset_names(files: list[ManifestFile]) -> list[str]:
    return sorted({f.dataset for f in files})


@dataclass
class FetchResult:
    path: str
    action: str  #: ``downloaded``, ``derived`` or ``present``
    size: int


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def is_intact(dest: Path, entry: ManifestFile) -> bool:
    target = dest / entry.path
    return target.is_file() and target.stat().st_size == entry.size and \
        _sha256(target) == entry.sha256


@contextmanager
def _checked_output(dest: Path, entry: ManifestFile) -> Iterator[IO[bytes]]:
    """A temp file next to the target; moved into place only when size and sha256 match."""
    target = dest / entry.path
    target.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=target.parent, prefix=".fetch-", delete=False)
    temp = Path(handle.name)
    try:
        with handle:
            yield handle
        size, digest = temp.stat().st_size, _sha256(temp)
        if (size, digest) != (entry.size, entry.sha256):
            raise FetchError(f"{entry.path}: got {size} bytes with sha256 {digest}; the "
                             f"manifest pins {entry.size} bytes with sha256 {entry.sha256}")
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def _url(entry: ManifestFile, mirror: str | None) -> str:
    if mirror:
        return f"{mirror.rstrip('/')}/{entry.path}"
    assert entry.url is not None
    return entry.url


def _download(client: httpx.Client, dest: Path, entry: ManifestFile, mirror: str | None,
              progress: Callable[[int], None]) -> None:
    url = _url(entry, mirror)
    with _checked_output(dest, entry) as out:
        try:
            with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise FetchError(f"{entry.path}: {url} answered {response.status_code}")
                for block in response.iter_bytes(CHUNK):
                    out.write(block)
                    progress(len(block))
        except httpx.HTTPError as error:
            raise FetchError(f"{entry.path}: cannot download {url}: {error}") from None


def _derive(dest: Path, entry: ManifestFile) -> None:
    """Concatenate the listed files, then the named member of the listed tar archive."""
    assert entry.derive is not None
    with _checked_output(dest, entry) as out:
        for part in entry.derive.get("concat", []):
            out.write((dest / part).read_bytes())
        member = entry.derive.get("tar_member")
        if member:
            archive, name = member
            with tarfile.open(dest / archive) as tar:
                extracted = tar.extractfile(name)
                if extracted is None:
                    raise FetchError(f"{entry.path}: {archive} has no file {name!r}")
                out.write(extracted.read())


def select(files: list[ManifestFile], datasets: list[str]) -> list[ManifestFile]:
    """The files of ``datasets`` (all when empty); an unknown name is a 422 naming it."""
    known = dataset_names(files)
    for name in datasets:
        if name not in known:
            raise InvalidInput("dataset", f"unknown dataset {name!r}; known: {', '.join(known)}")
    wanted = set(datasets or known)
    chosen = [f for f in files if f.dataset in wanted]
    return [f for f in chosen if f.derive is None] + [f for f in chosen if f.derive is not None]


def fetch(dest: Path, datasets: list[str], *, mirror: str | None = None,
          files: list[ManifestFile] | None = None,
          transport: httpx.BaseTransport | None = None,
          progress: Callable[[int], None] = lambda _n: None) -> list[FetchResult]:
    """Download (or rebuild) every file of ``datasets`` that is not already intact."""
    chosen = select(files if files is not None else load_manifest(), datasets)
    results = []
    with httpx.Client(timeout=TIMEOUT_SECONDS, follow_redirects=True,
                      transport=transport) as client:
        for entry in chosen:
            if is_intact(dest, entry):
                results.append(FetchResult(entry.path, "present", entry.size))
                progress(entry.size)
                continue
            if entry.derive is not None:
                _derive(dest, entry)
                progress(entry.size)
                results.append(FetchResult(entry.path, "derived", entry.size))
            else:
                _download(client, dest, entry, mirror, progress)
                results.append(FetchResult(entry.path, "downloaded", entry.size))
    return results
