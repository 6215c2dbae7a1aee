"""eStargz format: writer round trip, footer, TOC validation, TOC digest verification."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import random
import struct
import tarfile
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpucloud.images import testing as t
from gpucloud.images.errors import DigestMismatch
from gpucloud.images.lazy.estargz import (
    ConvertedLayer,
    convert_layer,
    decompress_chunk,
    read_file,
    read_toc,
    read_toc_file,
)
from gpucloud.images.lazy.fetch import RangeFetcher
from gpucloud.images.lazy.footer import (
    FOOTER_SIZE,
    LEGACY_FOOTER_SIZE,
    ExternalToc,
    footer_bytes,
    parse_footer,
)
from gpucloud.images.lazy.layer import read_toc as layer_read_toc
from gpucloud.images.lazy.toc import (
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    TOC_NAME,
    InvalidToc,
    TocEntry,
    parse_toc,
)
from gpucloud.images.unpack import Whiteouts, unpack_layer

CHUNK = 64 * 1024
# cap_net_bind_service, effective (a VFS_CAP_REVISION_2 value; binary, not UTF-8)
CAP = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)
# The footer of a real ctr-remote 0.12 layer whose TOC is at 0x900d66.
REAL_FOOTER = bytes.fromhex(
    "1f8b08040000000000ff1a00534716003030303030303030303039303064363653544152475a010000ff"
    "ff0000000000000000")


def _files() -> dict[str, bytes | str | t.Entry]:
    rng = random.Random(7)
    return {
        "bin/tool": t.file(rng.randbytes(3 * CHUNK + 123), 0o755),
        "bin/exact": t.file(rng.randbytes(CHUNK)),
        "etc/conf": "key=value\n",
        "etc/owned": t.file("mine", 0o600, uid=1000, gid=1000),
        "etc/empty": "",
        "etc/link": t.hardlink("etc/conf"),
        "etc/sym": t.symlink("conf"),
        "var": t.directory(0o1777),
        "gone": t.whiteout(),
        "opq": t.opaque(),
        "fifo": t.fifo(),
    }


def _tar_with_xattr(tmp_path: Path) -> Path:
    """The test files plus a file with a binary security.capability xattr (PAX)."""
    stream = io.BytesIO(t.layer_tar(_files()))
    with tarfile.open(fileobj=stream, mode="a", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("bin/cap")
        data = b"capable"
        info.size, info.mode = len(data), 0o755
        info.pax_headers = {"SCHILY.xattr.security.capability":
                            CAP.decode("utf-8", "surrogateescape")}
        tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "layer.tar"
    path.write_bytes(stream.getvalue())
    return path


def _convert(tmp_path: Path, **kwargs: Any) -> tuple[Path, Path, ConvertedLayer]:
    src = _tar_with_xattr(tmp_path)
    out = tmp_path / "layer.esgz"
    with out.open("wb") as f:
        layer = convert_layer(src, f, chunk_size=CHUNK, level=6, **kwargs)
    return src, out, layer


def _fetcher(path: Path) -> Any:
    data = path.read_bytes()
    return lambda start, end: data[start:end]


def test_round_trip_every_file_by_chunks(tmp_path: Path) -> None:
    src, out, layer = _convert(tmp_path)
    toc = read_toc_file(out, layer.toc_digest)
    fetch = _fetcher(out)
    with tarfile.open(src) as tar:
        regular = [m for m in tar.getmembers() if m.isreg()]
        for member in regular:
            want = tar.extractfile(member).read()  # type: ignore[union-attr]
            got = b"".join(read_file(fetch, toc, member.name))
            assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest(), member.name
    assert len(toc.chunks_of("bin/tool")) == 4
    assert [e.type for e in toc.entries if e.name == "bin/tool"] == ["reg"] + ["chunk"] * 3
    # a hard link reads as its target
    assert b"".join(read_file(fetch, toc, "etc/link")) == b"key=value\n"


def test_layer_is_still_a_valid_gzip_tar_with_right_digests(tmp_path: Path) -> None:
    src, out, layer = _convert(tmp_path)
    blob = out.read_bytes()
    raw = gzip.decompress(blob)
    assert layer.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert layer.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert layer.uncompressed_size == len(raw)
    assert raw.endswith(b"\0" * 1024)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        names = tar.getnames()
        toc_json = tar.extractfile(TOC_NAME).read()  # type: ignore[union-attr]
        cap = tar.getmember("bin/cap").pax_headers["SCHILY.xattr.security.capability"]
    assert names[0] == NO_PREFETCH_LANDMARK and names[-1] == TOC_NAME
    assert layer.toc_digest == "sha256:" + hashlib.sha256(toc_json).hexdigest()
    assert cap.encode("utf-8", "surrogateescape") == CAP
    assert blob[-FOOTER_SIZE:] == footer_bytes(layer.toc.toc_offset)


def test_toc_fields_as_real_writers_emit_them(tmp_path: Path) -> None:
    _, out, layer = _convert(tmp_path)
    doc = json.loads(read_toc_file(out, layer.toc_digest).encode())
    by_name = {e["name"]: e for e in doc["entries"] if e["type"] != "chunk"}
    assert doc["version"] == 1
    assert "uid" not in by_name["etc/conf"] and "gid" not in by_name["etc/conf"]
    assert by_name["etc/owned"]["uid"] == 1000 and by_name["etc/owned"]["mode"] == 0o600
    assert "offset" not in by_name["etc/empty"] and "chunkDigest" not in by_name["etc/empty"]
    assert by_name["etc/link"]["type"] == "hardlink"
    assert by_name["etc/link"]["linkName"] == "etc/conf"
    assert by_name[".wh.gone"]["type"] == "reg" and by_name["opq/.wh..wh..opq"]
    assert by_name["var/"]["type"] == "dir" and by_name["fifo"]["type"] == "fifo"
    assert by_name["bin/cap"]["xattrs"] == {
        "security.capability": base64.b64encode(CAP).decode()}
    assert by_name["bin/exact"]["chunkSize"] == CHUNK  # a full chunk keeps its size
    chunks = [e for e in doc["entries"] if e["name"] == "bin/tool"]
    assert "chunkSize" not in chunks[-1] and all("innerOffset" not in e for e in chunks)
    assert all(e["chunkDigest"].startswith("sha256:") for e in chunks)


def test_prioritized_files_come_first_with_parents_then_landmark(tmp_path: Path) -> None:
    _, out, layer = _convert(tmp_path, prioritized=["/etc/link", "/bin/tool", "/nope"])
    toc = read_toc_file(out, layer.toc_digest)
    names = [e.name for e in toc.entries if e.type != "chunk"]
    landmark = names.index(PREFETCH_LANDMARK)
    # etc/link is a hard link: its target comes before it; no parent dir entries exist here
    assert names[:landmark] == ["etc/conf", "etc/link", "bin/tool"]
    assert layer.missed == ("/nope",)
    mark = toc.entry(PREFETCH_LANDMARK)
    assert mark is not None and toc.prefetch_end() == mark.offset
    # everything prioritized lies entirely before the landmark's member
    assert max(r.end for r in toc.chunks_of("bin/tool")) <= mark.offset


def test_full_pull_hides_toc_and_landmarks(tmp_path: Path) -> None:
    src, out, _ = _convert(tmp_path, prioritized=["etc/conf"])
    esgz, plain = tmp_path / "esgz", tmp_path / "plain"
    esgz.mkdir()
    plain.mkdir()
    unpack_layer(out, esgz, Whiteouts.OVERLAY)
    unpack_layer(src, plain, Whiteouts.OVERLAY)
    assert sorted(os.listdir(esgz)) == sorted(os.listdir(plain))
    assert not (esgz / TOC_NAME).exists() and not (esgz / PREFETCH_LANDMARK).exists()
    if os.geteuid() == 0:
        assert os.getxattr(esgz / "bin/cap", "security.capability") == CAP


# -- footer ------------------------------------------------------------------------------


def test_footer_matches_a_real_one_and_parses() -> None:
    assert footer_bytes(0x900D66) == REAL_FOOTER
    assert parse_footer(b"junk" + REAL_FOOTER) == 0x900D66
    assert gzip.decompress(REAL_FOOTER) == b""


def _legacy_footer(offset: int) -> bytes:
    payload = f"{offset:016x}STARGZ".encode()
    head = b"\x1f\x8b\x08\x04\x00\x00\x00\x00\x00\xff" + struct.pack("<H", len(payload))
    return head + payload + b"\x01\x00\x00\xff\xff" + b"\x00" * 8


def test_legacy_47_byte_footer_is_accepted() -> None:
    legacy = _legacy_footer(12345)
    assert len(legacy) == LEGACY_FOOTER_SIZE and gzip.decompress(legacy) == b""
    assert parse_footer(legacy) == 12345
    assert parse_footer(b"x" * 100 + legacy) == 12345


@pytest.mark.parametrize("tail", [REAL_FOOTER[-46:], REAL_FOOTER[:-1], b"", b"\0" * 60,
                                  REAL_FOOTER.replace(b"STARGZ", b"STARGX")])
def test_truncated_or_bad_footer_is_refused(tail: bytes) -> None:
    with pytest.raises(InvalidToc):
        parse_footer(tail)


def test_external_toc_footer_is_recognised() -> None:
    with pytest.raises(ExternalToc):
        parse_footer(b"\x1f\x8b" + b"0" * 16 + b"STARGZEXTERNALTOC" + b"\0" * 11)


# -- TOC validation ----------------------------------------------------------------------


def _toc(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"version": 1, "entries": list(entries)}).encode()


DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("name", ["../etc/passwd", "a/../../b", "/etc/passwd", "", "a\x00b"])
def test_toc_refuses_escaping_names(name: str) -> None:
    with pytest.raises(InvalidToc):
        parse_toc(_toc({"name": name, "type": "dir"}), 1000)


def test_toc_refuses_escaping_hardlink_target() -> None:
    with pytest.raises(InvalidToc):
        parse_toc(_toc({"name": "x", "type": "hardlink", "linkName": "../../etc/shadow"}), 10)


@pytest.mark.parametrize("entry", [
    {"name": "f", "type": "reg", "size": 5, "offset": 2000, "chunkDigest": DIGEST},
    {"name": "f", "type": "reg", "size": 5, "offset": -1, "chunkDigest": DIGEST},
    {"name": "f", "type": "reg", "size": 5, "offset": 10},  # no digest: unverifiable
    {"name": "f", "type": "reg", "size": 5, "offset": 10, "chunkSize": 9,
     "chunkDigest": DIGEST},
    {"name": "f", "type": "socket"},
    {"name": "f", "type": "reg", "size": "5"},
    {"name": "f", "type": "reg", "size": True},
    {"type": "reg"},
    {"name": "f"},
    {"name": 5, "type": "reg"},
    {"name": "f", "type": "reg", "size": 5, "offset": 10, "chunkDigest": DIGEST + "\n"},
    {"name": "f", "type": "reg", "size": 5, "offset": 10,
     "chunkDigest": DIGEST + "\n" + DIGEST},  # two digests' worth in one value
    {"name": "f", "type": "reg", "size": 5, "offset": 10, "chunkDigest": DIGEST.upper()},
    {"name": "f", "type": "reg", "size": 5, "offset": 10, "chunkDigest": DIGEST,
     "digest": "sha256:abc"},
])
def test_toc_refuses_out_of_range_or_malformed_entries(entry: dict[str, Any]) -> None:
    with pytest.raises(InvalidToc):
        parse_toc(_toc(entry), 1000, toc_offset=900)


def _alike(count: int, **fault: Any) -> list[dict[str, Any]]:
    """``count`` small files with the same keys (one key layout), the last one with the
    fields of ``fault`` (same keys, bad values)."""
    out = [{"name": f"d/f{i}", "type": "reg", "size": 4, "modtime": "", "mode": 0o644,
            "offset": 10 + 10 * i, "digest": DIGEST, "chunkDigest": DIGEST}
           for i in range(count)]
    out[-1].update(fault)
    return out


@pytest.mark.parametrize("fault", [
    {"offset": -1}, {"size": True}, {"mode": "644"}, {"type": "socket"}, {"name": "../x"},
    {"name": "d/../../x"}, {"name": "/x"}, {"name": ""}, {"name": "d/\x00"},
    {"name": None}, {"type": None}, {"offset": 950}, {"chunkDigest": DIGEST.upper()},
    {"digest": "sha256:" + "ab" * 25 + "abcdeab" + "sha256:"},  # 71 characters
    {"digest": DIGEST[:-1] + "g"}, {"digest": DIGEST[:-1] + "\u00e9"}, {"digest": 5},
])
def test_toc_refuses_one_bad_entry_among_many_alike(fault: dict[str, Any]) -> None:
    """The parser checks entries of one key layout together, a field at a time: the one
    bad entry at the end of many must still be found."""
    parse_toc(_toc(*_alike(40)), 1000, toc_offset=900)  # the same without the fault: fine
    with pytest.raises(InvalidToc):
        parse_toc(_toc(*_alike(40, **fault)), 1000, toc_offset=900)


def test_toc_entries_alike_keep_nulls_names_and_owner_names() -> None:
    """Nulls are defaults, ``..`` inside a name is no component, modes are masked and
    owner names carry over to later entries of their uid, in a layout's entries too."""
    files = _alike(5, name="d/a..b", mode=0o100644, size=None)
    files[1]["uid"] = 7  # its own layout
    owner = {"name": "d", "type": "dir", "uid": 7, "userName": "u7"}
    late = {"name": "d/late", "type": "reg", "size": 0, "uid": 7}
    toc = parse_toc(_toc(owner, *files, late), 1000, toc_offset=900)
    last = toc.entry("d/a..b")
    assert last is not None and last.size == 0 and last.mode == 0o644
    assert [e.uname for e in toc.entries] == ["u7", "", "u7", "", "", "", "u7"]
    assert TocEntry("d/f0", "reg", 4, mode=0o644, offset=10, digest=DIGEST,
                    chunkDigest=DIGEST) == toc.entry("d/f0")
    assert toc.chunks_of("d/f3")[0].digest == DIGEST and toc.chunks_of("d/a..b") == []


def test_toc_refuses_backwards_offsets_and_gaps_in_chunks() -> None:
    a = {"name": "a", "type": "reg", "size": 4, "offset": 50, "chunkDigest": DIGEST}
    b = {"name": "b", "type": "reg", "size": 4, "offset": 20, "chunkDigest": DIGEST}
    with pytest.raises(InvalidToc, match="backwards"):
        parse_toc(_toc(a, b), 100)
    head = {"name": "c", "type": "reg", "size": 8, "offset": 10, "chunkSize": 4,
            "chunkDigest": DIGEST}
    gap = {"name": "c", "type": "chunk", "offset": 20, "chunkOffset": 5, "chunkDigest": DIGEST}
    with pytest.raises(InvalidToc, match="tile"):
        parse_toc(_toc(head, gap), 100)


def test_toc_nulls_are_defaults_and_entries_equal_built_ones() -> None:
    """The parser fills entries without the dataclass's ``__init__``: what it returns must
    still equal an entry built the ordinary way."""
    data = _toc({"name": "./d/f", "type": "reg", "size": 3, "offset": 10, "mode": None,
                 "uid": None, "linkName": None, "chunkDigest": DIGEST})
    ent = parse_toc(data, 100, toc_offset=60).entries[0]
    built = TocEntry("./d/f", "reg", 3, offset=10, chunkDigest=DIGEST)
    assert ent == built and ent.path == built.path == "d/f"
    assert ent.mode == 0 and ent.linkName == "" and ent.xattrs == {}


def test_toc_tolerates_crfs_style_and_newer_writers() -> None:
    """Old CRFS mode bits and NumLink, names only on first use, innerOffset."""
    data = _toc(
        {"name": "d/", "type": "dir", "mode": 16877, "NumLink": 0, "uid": 5,
         "userName": "u"},
        {"name": "d/a", "type": "reg", "size": 3, "offset": 10, "innerOffset": 0,
         "chunkDigest": DIGEST, "uid": 5},
        {"name": "d/b", "type": "reg", "size": 3, "offset": 10, "innerOffset": 512,
         "chunkDigest": DIGEST},
    )
    toc = parse_toc(data, 100, toc_offset=60)
    d = toc.entry("d")
    a = toc.entry("./d/a")
    assert d is not None and d.mode == 0o755 and a is not None and a.uname == "u"
    (ref,) = toc.chunks_of("d/b")
    assert (ref.offset, ref.end, ref.inner_offset, ref.chunk_size) == (10, 60, 512, 3)


# -- verification ----------------------------------------------------------------------


def test_toc_digest_mismatch_is_refused(tmp_path: Path) -> None:
    _, out, layer = _convert(tmp_path)
    with pytest.raises(DigestMismatch, match="TOC"):
        read_toc_file(out, "sha256:" + "00" * 32)
    assert read_toc_file(out, layer.toc_digest).toc_offset == layer.toc.toc_offset


def test_tampered_toc_member_does_not_match_its_digest(tmp_path: Path) -> None:
    """Swap in a TOC that points somewhere else: the annotation catches it."""
    _, out, layer = _convert(tmp_path)
    blob = bytearray(out.read_bytes())
    toc_json = layer.toc.encode().replace(b'"etc/conf"', b'"etc/CONF"')
    info = tarfile.TarInfo(TOC_NAME)
    info.size = len(toc_json)
    member = zlib.compressobj(6, zlib.DEFLATED, 31)
    raw = info.tobuf(tarfile.USTAR_FORMAT) + toc_json + b"\0" * (-len(toc_json) % 512 + 1024)
    forged = blob[:layer.toc.toc_offset] + member.compress(raw) + member.flush()
    forged += footer_bytes(layer.toc.toc_offset)
    with pytest.raises(DigestMismatch):
        read_toc(lambda s, e: bytes(forged[s:e]), len(forged), layer.toc_digest)


def test_corrupted_chunk_is_refused(tmp_path: Path) -> None:
    _, out, layer = _convert(tmp_path)
    toc = read_toc_file(out, layer.toc_digest)
    ref = toc.chunks_of("bin/tool")[1]
    good = out.read_bytes()[ref.offset:ref.end]
    assert len(decompress_chunk(good, ref)) == CHUNK
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(DigestMismatch):
        decompress_chunk(bytes(bad), ref)
    other = toc.chunks_of("bin/tool")[2]
    with pytest.raises(DigestMismatch):  # right bytes, wrong chunk
        decompress_chunk(good, other)


# -- the daemon's TOC read (layer.read_toc, over HTTP Range) ------------------------------


class _BlobHandler(BaseHTTPRequestHandler):
    """Serves one blob (the server's ``blob``) whole, or one ``Range`` of it."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        blob: bytes = self.server.blob  # type: ignore[attr-defined]
        wanted = self.headers.get("Range")
        status, body, extra = 200, blob, {}
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            body = blob[int(first):int(last) + 1]
            status = 206
            extra = {"Content-Range": f"bytes {first}-{int(first) + len(body) - 1}/{len(blob)}"}
        self.send_response(status)
        for key, value in extra.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    do_HEAD = do_GET


@contextmanager
def _range_fetcher(blob: bytes) -> Iterator[RangeFetcher]:
    """A ``RangeFetcher`` of ``blob`` served by a loopback HTTP server."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BlobHandler)
    server.blob = blob  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client() as http:
            yield RangeFetcher(http, http, f"http://127.0.0.1:{server.server_port}/blob",
                               len(blob))
    finally:
        server.shutdown()
        server.server_close()


def test_the_daemons_toc_read_takes_a_legacy_footer(tmp_path: Path) -> None:
    """A 47-byte footer ends the TOC member 4 bytes later than a 51-byte one would: cut at
    51, the member lost its size field (and was parsed only because nothing checked)."""
    _, out, layer = _convert(tmp_path)
    blob = out.read_bytes()[:-FOOTER_SIZE] + _legacy_footer(layer.toc.toc_offset)
    with _range_fetcher(blob) as fetcher:
        toc, data = layer_read_toc(fetcher, layer.toc_digest)
    assert "sha256:" + hashlib.sha256(data).hexdigest() == layer.toc_digest
    assert {e.name for e in toc.entries} == {e.name for e in layer.toc.entries}


def test_the_daemons_toc_read_refuses_a_truncated_toc_member(tmp_path: Path) -> None:
    _, out, layer = _convert(tmp_path)
    blob = out.read_bytes()
    offset = layer.toc.toc_offset
    member = blob[offset:-FOOTER_SIZE]
    cut = blob[:offset] + member[:-4] + footer_bytes(offset)
    with _range_fetcher(cut) as fetcher, pytest.raises(InvalidToc, match="truncated"):
        layer_read_toc(fetcher, layer.toc_digest)
