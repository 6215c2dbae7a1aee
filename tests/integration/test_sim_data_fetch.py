"""``gpucloud sim data fetch`` against a real HTTP server on loopback, and where the
simulator looks for its traces."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.core.errors import InvalidInput
from gpucloud.sim import data
from gpucloud.sim.fetch import FetchError, fetch, load_manifest

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on 127.0.0.1 serving the folder it yields (as ``<base>/<path>``)."""
    root = tmp_path / "upstream"
    root.mkdir()
    handler = functools.partial(_Quiet, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


def _entry(path: str, content: bytes, url: str | None) -> dict[str, object]:
    out: dict[str, object] = {"path": path, "bytes": len(content),
                              "sha256": hashlib.sha256(content).hexdigest()}
    if url is not None:
        out["url"] = url
    return out


def _tar(member: str, content: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo(member)
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _upstream(base: str, root: Path) -> str:
    """A manifest of two datasets served under ``/repo/…`` (other paths than the local
    layout: the URLs are followed); one file is derived from a header and a tar member."""
    files = {"ds1/jobs.csv": b"job_id,num_gpu\n1,8\n", "ds1/README.md": b"# ds1\n",
             "ds2/spec.header": b"a,b\n", "ds2/spec.tar.gz": _tar("spec.csv", b"1,2\n3,4\n")}
    entries = []
    for path, content in files.items():
        (root / "repo" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "repo" / path).write_bytes(content)
        entries.append(_entry(path, content, f"{base}/repo/{path}"))
    derived = _entry("ds2/spec_with_header.csv", b"a,b\n1,2\n3,4\n", None)
    derived["derive"] = {"concat": ["ds2/spec.header"],
                         "tar_member": ["ds2/spec.tar.gz", "spec.csv"]}
    return json.dumps({"version": 1, "files": [derived, *entries]})


def test_fetch_downloads_checks_and_derives(served: tuple[str, Path], tmp_path: Path) -> None:
    base, root = served
    files = load_manifest(_upstream(base, root))
    dest = tmp_path / "data"
    results = fetch(dest, [], files=files)
    assert sorted((r.path, r.action) for r in results) == [
        ("ds1/README.md", "downloaded"), ("ds1/jobs.csv", "downloaded"),
        ("ds2/spec.header", "downloaded"), ("ds2/spec.tar.gz", "downloaded"),
        ("ds2/spec_with_header.csv", "derived")]
    assert (dest / "ds2/spec_with_header.csv").read_bytes() == b"a,b\n1,2\n3,4\n"
    assert (dest / "ds1/jobs.csv").read_bytes() == b"job_id,num_gpu\n1,8\n"
    # A rerun downloads nothing; a damaged file is fetched again.
    (dest / "ds1/jobs.csv").write_bytes(b"job_id,num_gpu\n1,9\n")
    again = {r.path: r.action for r in fetch(dest, ["ds1"], files=files)}
    assert again == {"ds1/jobs.csv": "downloaded", "ds1/README.md": "present"}


def test_a_changed_upstream_file_is_refused_and_nothing_is_left(
        served: tuple[str, Path], tmp_path: Path) -> None:
    base, root = served
    files = load_manifest(_upstream(base, root))
    (root / "repo/ds1/jobs.csv").write_bytes(b"job_id,num_gpu\n1,1\n")  # same size
    dest = tmp_path / "data"
    pinned = "ds1/jobs.csv: got 19 bytes with sha256 [0-9a-f]{64}; the manifest pins 19"
    with pytest.raises(FetchError, match=pinned):
        fetch(dest, ["ds1"], files=files)
    assert not (dest / "ds1/jobs.csv").exists()
    assert [p.name for p in (dest / "ds1").iterdir() if p.name.startswith(".fetch-")] == []


def test_missing_upstream_file_and_unknown_dataset(served: tuple[str, Path],
                                                  tmp_path: Path) -> None:
    base, root = served
    files = load_manifest(_upstream(base, root))
    (root / "repo/ds1/README.md").unlink()
    with pytest.raises(FetchError, match="ds1/README.md: .* answered 404"):
        fetch(tmp_path / "data", ["ds1"], files=files)
    with pytest.raises(InvalidInput, match="dataset: unknown dataset 'nope'"):
        fetch(tmp_path / "data", ["nope"], files=files)


def test_shipped_manifest_pins_every_shared_file() -> None:
    """Every file of ../shared/data (but the notes written for that copy) is in the shipped
    manifest with the same size and sha256, and has an upstream URL or a recipe."""
    listing = SHARED / "MANIFEST.tsv"
    if not listing.is_file():
        pytest.skip("no ../shared/data here")
    shipped = {f.path: f for f in load_manifest()}
    for line in listing.read_text().splitlines()[1:]:
        path, size, _rows, sha = line.split("\t")
        if "/" not in path or path.endswith("PROVENANCE.md"):
            continue
        entry = shipped.pop(path)
        assert (entry.size, entry.sha256) == (int(size), sha), path
        assert entry.derive or (entry.url or "").startswith("https://raw.githubusercontent.com/")
    assert shipped == {}


def test_cli_fetches_a_real_trace_from_a_mirror(served: tuple[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The real manifest's files for two traces, served from a copy on loopback
    (``--mirror`` overrides the upstream URLs); the PAI machine list is rebuilt."""
    if not (SHARED / "tiresias-60job").is_dir():
        pytest.skip("no ../shared/data here")
    base, root = served
    for name in ("tiresias-60job", "alibaba-pai-2020"):
        for source in (SHARED / name).rglob("*"):
            if source.is_file() and source.name != "pai_machine_spec_with_header.csv":
                target = root / source.relative_to(SHARED)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
    monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["sim", "data", "fetch", "tiresias-60job",
                                      "alibaba-pai-2020", "--mirror", base])
    assert result.exit_code == 0, result.output
    assert "26 file(s) fetched, 0 already present" in result.output
    fetched = tmp_path / "home" / "data"
    for name in ("tiresias-60job/60_job.csv", "alibaba-pai-2020/pai_machine_spec_with_header.csv"):
        assert (fetched / name).read_bytes() == (SHARED / name).read_bytes()
    bad = CliRunner().invoke(app, ["sim", "data", "fetch", "nope", "--mirror", base])
    assert bad.exit_code == 1
    assert "unknown dataset 'nope'" in bad.output


def test_lookup_order_and_the_missing_message(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    env_root, home = tmp_path / "env", tmp_path / "home"
    (env_root / "fleet-only-env").mkdir(parents=True)
    (home / "data" / "fleet-only-home").mkdir(parents=True)
    (home / "data" / "fleet-only-env").mkdir(parents=True)
    monkeypatch.setenv("GPUCLOUD_SHARED_DATA", str(env_root))
    monkeypatch.setenv("GPUCLOUD_HOME", str(home))
    assert data.dataset_dir("fleet-only-env") == env_root / "fleet-only-env"
    assert data.dataset_dir("fleet-only-home") == home / "data" / "fleet-only-home"
    roots = data.data_roots()
    assert roots[0] == env_root and roots[-1] == home / "data"
    with pytest.raises(data.MissingData) as missing:
        data.dataset_dir("fleet-nowhere")
    message = missing.value.message
    assert "trace 'fleet-nowhere' is missing" in message
    assert str(env_root) in message and str(home / "data") in message
    assert "`gpucloud sim data fetch fleet-nowhere`" in message
