"""Writing and reading eStargz layers (``containerd/stargz-snapshotter/estargz``).

Writer (:func:`convert_layer`): reads an uncompressed layer tar and writes a blob that is
still one valid tar.gz, made of gzip members: one opens at the blob's start, at every chunk
(``chunk_size``, 4 MiB by default) of every non-empty regular file's payload, before each
landmark entry, at the TOC entry (which also carries the tar end-of-archive blocks) and at
the footer. The TOC lists every entry with the offset of its payload member and a sha256 per
chunk; the 2nd and later chunks of a file are entries of type ``chunk``. Files named in
``prioritized`` (and their parent directories, and hard-link targets) come first, in that
order, followed by ``.prefetch.landmark``; without any, ``.no.prefetch.landmark`` leads.
Members are compressed in a thread pool (zlib releases the GIL), so level 9 uses every core.

Reader (:func:`read_toc`): fetches the tail by range, parses the footer, decompresses the TOC
member, checks the sha256 of the TOC JSON against the layer's annotation *before* parsing
it, and validates it (:func:`~gpucloud.images.lazy.toc.parse_toc`). :func:`decompress_chunk`
turns one chunk's compressed extent into verified bytes.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
import posixpath
import tarfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from gpucloud.images.errors import DigestMismatch, InvalidImage
from gpucloud.images.lazy.footer import FOOTER_SIZE, footer_bytes, parse_footer
from gpucloud.images.lazy.toc import (
    DEFAULT_CHUNK_SIZE,
    LANDMARK_CONTENTS,
    LANDMARKS,
    MAX_TOC_SIZE,
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    TOC_NAME,
    ChunkRef,
    InvalidToc,
    Toc,
    TocEntry,
    clean_name,
    parse_toc,
)

DEFAULT_LEVEL = 9
TAIL_FETCH = 1 << 20
_BLOCK = 512
_TYPES = {
    tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.CONTTYPE: "reg",
    tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo",
    tarfile.GNUTYPE_SPARSE: "reg",
}

_EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()

FetchRange = Callable[[int, int], bytes]
"""``fetch(start, end)``: bytes ``[start, end)`` of the blob."""


@dataclass(frozen=True)
class ConvertedLayer:
    """What a converted layer's descriptor and the config need."""

    digest: str
    size: int
    diff_id: str
    toc_digest: str
    uncompressed_size: int
    toc: Toc
    missed: tuple[str, ...] = ()


# -- writing ---------------------------------------------------------------------------


@dataclass
class _Pending:
    """A TOC entry whose ``offset`` is the start of member number ``member`` (or none)."""

    fields: dict[str, object]
    member: int = -1


@dataclass
class _Members:
    """Splits the uncompressed stream into gzip members, compressing them in a pool."""

    out: _HashingWriter
    level: int
    pool: ThreadPoolExecutor
    window: int
    parts: list[bytes] | None = None
    count: int = 0
    starts: list[int] = field(default_factory=list)
    written: int = 0
    raw_hash: hashlib._Hash = field(default_factory=hashlib.sha256)
    raw_size: int = 0
    inflight: deque[Future[bytes]] = field(default_factory=deque)

    def write(self, data: bytes) -> None:
        """Append to the current member, opening one if none is open."""
        if self.parts is None:
            self.parts = []
        self.parts.append(data)
        self.raw_hash.update(data)
        self.raw_size += len(data)

    def new(self) -> int:
        """Close the current member; the next write opens member number (returned)."""
        self.close()
        return self.count

    def close(self) -> None:
        if self.parts is None:
            return
        raw, self.parts = b"".join(self.parts), None
        self.inflight.append(self.pool.submit(_gzip_member, raw, self.level))
        self.count += 1
        while len(self.inflight) > self.window:
            self._drain_one()

    def finish(self) -> None:
        self.close()
        while self.inflight:
            self._drain_one()

    def _drain_one(self) -> None:
        data = self.inflight.popleft().result()
        self.starts.append(self.written)
        self.out.write(data)
        self.written += len(data)


def _gzip_member(raw: bytes, level: int) -> bytes:
    comp = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return comp.compress(raw) + comp.flush()


def convert_layer(
    tar_path: Path,
    out: BinaryIO,
    *,
    prioritized: Sequence[str] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
) -> ConvertedLayer:
    """Write the eStargz form of the uncompressed layer tar at ``tar_path`` to ``out``.

    ``prioritized`` lists paths (as in the layer, ``/`` prefix allowed) in access order;
    paths the layer does not have are returned in ``missed``.
    """
    if chunk_size <= 0 or not 0 <= level <= 9:
        raise ValueError("chunk_size must be positive and level within 0..9")
    threads = workers or os.cpu_count() or 1
    with tarfile.open(tar_path, mode="r:") as tar, ThreadPoolExecutor(threads) as pool:
        members = [m for m in tar.getmembers() if clean_name(m.name) not in _SKIPPED]
        ordered, missed = _order(_dedupe(members), prioritized)
        hasher = _HashingWriter(out)
        stream = _Members(hasher, level, pool, window=threads * 2)
        pending = _write_entries(tar, ordered, stream, chunk_size, bool(prioritized))
        toc, toc_json = _write_toc(stream, pending, hasher)
    digest = "sha256:" + hasher.hash.hexdigest()
    return ConvertedLayer(
        digest=digest, size=hasher.size, diff_id="sha256:" + stream.raw_hash.hexdigest(),
        toc_digest="sha256:" + hashlib.sha256(toc_json).hexdigest(),
        uncompressed_size=stream.raw_size, toc=toc, missed=tuple(missed),
    )


_SKIPPED = LANDMARKS | {TOC_NAME}


class _HashingWriter(io.RawIOBase):
    def __init__(self, out: BinaryIO) -> None:
        super().__init__()
        self._out = out
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._out.write(data)
        self.hash.update(data)
        self.size += len(data)
        return len(data)


def _dedupe(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """A name that appears twice: the last one wins, as it would when unpacking."""
    last = {clean_name(m.name): i for i, m in enumerate(members)}
    return [m for i, m in enumerate(members) if last[clean_name(m.name)] == i]


def _order(
    members: list[tarfile.TarInfo], prioritized: Sequence[str]
) -> tuple[list[tarfile.TarInfo | None], list[str]]:
    """Prioritized entries (parents and link targets first), a landmark (None), the rest."""
    by_name = {clean_name(m.name): m for m in members}
    moved: dict[str, tarfile.TarInfo] = {}
    missed: list[str] = []

    def move(name: str, depth: int = 0) -> None:
        if name in moved or depth > 64:
            return
        if name == "" or name not in by_name:
            return
        move(posixpath.dirname(name), depth + 1)
        member = by_name[name]
        if member.islnk():
            move(clean_name(member.linkname), depth + 1)
        moved.setdefault(name, member)

    for raw in prioritized:
        name = clean_name(raw.lstrip("/"))
        if name not in by_name:
            missed.append(raw)
            continue
        move(name)
    root = [m for m in members if clean_name(m.name) == ""]
    first: list[tarfile.TarInfo | None] = [*root, *moved.values()] if moved else []
    rest = [m for m in members if clean_name(m.name) not in moved and m not in first]
    if not prioritized:
        return [None, *rest], missed
    return [*first, None, *rest], missed


def _write_entries(
    tar: tarfile.TarFile,
    ordered: list[tarfile.TarInfo | None],
    stream: _Members,
    chunk_size: int,
    has_priority: bool,
) -> list[_Pending]:
    pending: list[_Pending] = []
    names: tuple[dict[int, str], dict[int, str]] = ({}, {})
    for member in ordered:
        if member is None:
            member = _landmark(PREFETCH_LANDMARK if has_priority else NO_PREFETCH_LANDMARK)
            stream.new()
            source: IO[bytes] | None = io.BytesIO(LANDMARK_CONTENTS)
        else:
            source = tar.extractfile(member) if member.isreg() else None
        pending.extend(_write_entry(member, source, stream, chunk_size, names))
    return pending


def _landmark(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(LANDMARK_CONTENTS), 0, 0
    return info


def _write_entry(
    member: tarfile.TarInfo,
    source: IO[bytes] | None,
    stream: _Members,
    chunk_size: int,
    names: tuple[dict[int, str], dict[int, str]],
) -> list[_Pending]:
    """Header into the current member; payload chunks each in a fresh member."""
    kind = _TYPES.get(member.type)
    if kind is None:
        raise InvalidImage(f"layer entry {member.name!r} has unsupported tar type {member.type!r}")
    if kind == "reg" and member.type != tarfile.REGTYPE:
        member = _as_regular(member)
    stream.write(member.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    head = _Pending(_toc_fields(member, kind, names))
    if kind == "reg" and member.size == 0:
        head.fields["digest"] = _EMPTY_DIGEST  # as ctr-remote writes it; no offset, no chunk
    if kind != "reg" or member.size == 0:
        return [head]
    if source is None:
        raise InvalidImage(f"layer entry {member.name!r} has no content")
    entries = _write_payload(member, source, stream, chunk_size, head)
    pad = -member.size % _BLOCK
    if pad:
        stream.write(b"\0" * pad)
    return entries


def _as_regular(member: tarfile.TarInfo) -> tarfile.TarInfo:
    copy = member.replace(deep=False)
    copy.type = tarfile.REGTYPE
    copy.pax_headers = {k: v for k, v in member.pax_headers.items()
                        if not k.startswith("GNU.sparse")}
    return copy


def _write_payload(
    member: tarfile.TarInfo, source: IO[bytes], stream: _Members, chunk_size: int,
    head: _Pending,
) -> list[_Pending]:
    whole = hashlib.sha256()
    entries: list[_Pending] = []
    written, ent = 0, head
    while written < member.size:
        size = min(chunk_size, member.size - written)
        data = source.read(size)
        if len(data) != size:
            raise InvalidImage(f"layer entry {member.name!r} is truncated")
        ent.member = stream.new()
        ent.fields["chunkOffset"] = written
        if size == chunk_size:
            ent.fields["chunkSize"] = size
        ent.fields["chunkDigest"] = "sha256:" + hashlib.sha256(data).hexdigest()
        whole.update(data)
        stream.write(data)
        entries.append(ent)
        written += size
        ent = _Pending({"name": head.fields["name"], "type": "chunk"})
    head.fields["digest"] = "sha256:" + whole.hexdigest()
    return entries


def _toc_fields(
    m: tarfile.TarInfo, kind: str, names: tuple[dict[int, str], dict[int, str]]
) -> dict[str, object]:
    """The TOC fields of a tar header, as the Go writer fills them."""
    name = m.name + "/" if kind == "dir" and not m.name.endswith("/") else m.name
    fields: dict[str, object] = {
        "name": name, "type": kind, "mode": m.mode & 0o7777, "uid": m.uid, "gid": m.gid,
        "uname": _name_if_changed(names[0], m.uid, m.uname),
        "gname": _name_if_changed(names[1], m.gid, m.gname),
        "modtime": _modtime(m.mtime),
    }
    if kind == "reg":
        fields["size"] = m.size
    if kind in ("symlink", "hardlink"):
        fields["linkName"] = m.linkname
    if kind in ("char", "block"):
        fields["devMajor"], fields["devMinor"] = m.devmajor, m.devminor
    xattrs = {k[len("SCHILY.xattr."):]: v.encode("utf-8", "surrogateescape")
              for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
    if xattrs:
        fields["xattrs"] = xattrs
    return fields


def _name_if_changed(seen: dict[int, str], ident: int, name: str) -> str:
    if not name or seen.get(ident) == name:
        return ""
    seen[ident] = name
    return name


def _modtime(mtime: float) -> str:
    seconds = round(mtime)
    if seconds == 0:
        return ""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_toc(
    stream: _Members, pending: list[_Pending], out: _HashingWriter
) -> tuple[Toc, bytes]:
    """Flush the entries, then the TOC member (header, JSON, end-of-archive) and footer."""
    stream.finish()
    entries = tuple(
        TocEntry(**{**p.fields, "offset": stream.starts[p.member]})  # type: ignore[arg-type]
        if p.member >= 0 else TocEntry(**p.fields)  # type: ignore[arg-type]
        for p in pending
    )
    toc_offset = stream.written
    toc = Toc(version=1, entries=entries, toc_offset=toc_offset)
    toc_json = toc.encode()
    info = tarfile.TarInfo(TOC_NAME)
    info.size, info.mode, info.mtime = len(toc_json), 0o644, 0
    stream.write(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
    stream.write(toc_json + b"\0" * (-len(toc_json) % _BLOCK) + b"\0" * (2 * _BLOCK))
    stream.finish()
    out.write(footer_bytes(toc_offset))
    return toc, toc_json


# -- reading ---------------------------------------------------------------------------


def read_toc(fetch: FetchRange, blob_size: int, expected_toc_digest: str | None) -> Toc:
    """The verified TOC of a blob of ``blob_size`` bytes, fetched through ``fetch``.

    One range request for the last ``TAIL_FETCH`` bytes usually brings footer and TOC;
    otherwise a second one fetches the TOC member. ``expected_toc_digest`` is the layer's
    ``containerd.io/snapshot/stargz/toc.digest``; None skips the check (inspection only).
    """
    if blob_size < FOOTER_SIZE - 4:
        raise InvalidToc(f"blob of {blob_size} bytes is too small for an eStargz footer")
    tail_start = max(0, blob_size - TAIL_FETCH)
    tail = fetch(tail_start, blob_size)
    if len(tail) != blob_size - tail_start:
        raise InvalidToc("registry returned a short tail of the blob")
    toc_offset = parse_footer(tail)
    if toc_offset >= blob_size:
        raise InvalidToc(f"footer points past the blob end ({toc_offset} >= {blob_size})")
    member = tail[toc_offset - tail_start:] if toc_offset >= tail_start else fetch(
        toc_offset, blob_size)
    toc_json = _toc_json(member)
    actual = "sha256:" + hashlib.sha256(toc_json).hexdigest()
    if expected_toc_digest is not None and actual != expected_toc_digest:
        raise DigestMismatch(expected_toc_digest, f"the TOC hashed to {actual}", "TOC")
    return parse_toc(toc_json, blob_size, toc_offset)


def read_toc_file(path: Path, expected_toc_digest: str | None) -> Toc:
    """:func:`read_toc` over a local blob."""
    with path.open("rb") as f:
        def fetch(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start)

        return read_toc(fetch, path.stat().st_size, expected_toc_digest)


def _toc_json(member: bytes) -> bytes:
    """The JSON inside the TOC's gzip member (a tar entry named ``stargz.index.json``)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        raw = d.decompress(member, MAX_TOC_SIZE + 4 * _BLOCK)
    except zlib.error as e:
        raise InvalidToc(f"TOC member is not valid gzip: {e}") from None
    if not d.eof:
        raise InvalidToc("TOC member is truncated or larger than allowed")
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            info = tar.next()
            if info is None or clean_name(info.name) != TOC_NAME or not info.isreg():
                raise InvalidToc(f"TOC member holds no {TOC_NAME}")
            body = tar.extractfile(info)
            data = body.read() if body is not None else b""
    except tarfile.TarError as e:
        raise InvalidToc(f"TOC member is not a tar entry: {e}") from None
    if len(data) != info.size:
        raise InvalidToc("TOC entry is truncated")
    return data


def decompress_chunk(data: bytes, ref: ChunkRef) -> bytes:
    """The verified uncompressed bytes of one chunk from its compressed extent ``data``
    (``[ref.offset, ref.end)``). Raises :class:`DigestMismatch` on any disagreement."""
    want = ref.inner_offset + ref.chunk_size
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        raw = d.decompress(data, want)
    except zlib.error as e:
        raise DigestMismatch(ref.digest, f"chunk is not valid gzip ({e})", "chunk") from None
    chunk = raw[ref.inner_offset:want]
    if len(chunk) != ref.chunk_size:
        raise DigestMismatch(ref.digest, f"chunk decompressed to {len(chunk)} bytes", "chunk")
    actual = "sha256:" + hashlib.sha256(chunk).hexdigest()
    if actual != ref.digest:
        raise DigestMismatch(ref.digest, f"chunk hashed to {actual}", "chunk")
    return chunk


def read_file(fetch: FetchRange, toc: Toc, name: str) -> Iterator[bytes]:
    """Every verified chunk of file ``name``, in order (one range request per chunk)."""
    for ref in toc.chunks_of(name):
        yield decompress_chunk(fetch(ref.offset, ref.end), ref)
