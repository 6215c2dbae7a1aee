"""The eStargz table of contents (``stargz.index.json``): types, parsing, validation, encoding.

The JSON is the one containerd's stargz-snapshotter writes (``estargz/types.go``). Its Go
structs use ``omitempty``, so real TOCs leave out ``uid``/``gid``/``mode`` when they are 0,
empty files carry no ``offset``/``digest``/``chunkDigest`` and the last chunk of a file no
``chunkSize``; this module defaults all of those. Old CRFS-style TOCs put the file-type bits in
``mode`` and carry ``NumLink``: the mode is masked to ``0o7777`` and unknown keys are ignored.

The TOC is untrusted input (it comes from a registry): :func:`parse_toc` refuses names that are
absolute or contain ``..``, offsets outside the blob, chunks that do not tile their file, and
payloads that could not be verified (no chunk digest).
"""

from __future__ import annotations

import base64
import binascii
import gc
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpucloud.images.errors import InvalidImage

TOC_NAME = "stargz.index.json"
PREFETCH_LANDMARK = ".prefetch.landmark"
NO_PREFETCH_LANDMARK = ".no.prefetch.landmark"
LANDMARK_CONTENTS = b"\x0f"
LANDMARKS = frozenset({PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK})
HIDDEN_ROOT_NAMES = LANDMARKS | {TOC_NAME}
TOC_DIGEST_ANNOTATION = "containerd.io/snapshot/stargz/toc.digest"
UNCOMPRESSED_SIZE_ANNOTATION = "io.containers.estargz.uncompressed-size"
DEFAULT_CHUNK_SIZE = 4 << 20
MAX_TOC_SIZE = 256 << 20
TOC_VERSION = 1
ENTRY_TYPES = frozenset({"dir", "reg", "symlink", "hardlink", "char", "block", "fifo", "chunk"})

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_INT_FIELDS = (
    "size", "mode", "uid", "gid", "devMajor", "devMinor",
    "offset", "innerOffset", "chunkOffset", "chunkSize",
)


class InvalidToc(InvalidImage):
    """A TOC (or footer) that is malformed, unsafe or does not match its digest."""

    reason = "InvalidToc"


@dataclass(frozen=True)
class TocEntry:
    """One entry of ``stargz.index.json``; field names are the JSON keys (``uname`` is
    ``userName``, ``gname`` is ``groupName``)."""

    name: str
    type: str
    size: int = 0
    modtime: str = ""
    linkName: str = ""
    mode: int = 0
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    devMajor: int = 0
    devMinor: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=dict)
    digest: str = ""
    offset: int = 0
    innerOffset: int = 0
    chunkOffset: int = 0
    chunkSize: int = 0
    chunkDigest: str = ""

    @property
    def path(self) -> str:
        """The name cleaned for lookups: no ``./`` prefix, no trailing ``/``."""
        return clean_name(self.name)

    @property
    def has_payload(self) -> bool:
        """True for entries whose bytes live in a gzip member (non-empty reg, chunk)."""
        return self.type == "chunk" or (self.type == "reg" and self.size > 0)

    def to_json(self) -> dict[str, Any]:
        """The entry as the Go writer marshals it (``omitempty``, same key order)."""
        out: dict[str, Any] = {"name": self.name, "type": self.type}
        pairs: list[tuple[str, Any]] = [
            ("size", self.size), ("modtime", self.modtime), ("linkName", self.linkName),
            ("mode", self.mode), ("uid", self.uid), ("gid", self.gid),
            ("userName", self.uname), ("groupName", self.gname), ("offset", self.offset),
            ("innerOffset", self.innerOffset), ("devMajor", self.devMajor),
            ("devMinor", self.devMinor),
        ]
        out.update((k, v) for k, v in pairs if v)
        if self.xattrs:
            out["xattrs"] = {
                k: base64.b64encode(v).decode("ascii") for k, v in self.xattrs.items()
            }
        tail = [("digest", self.digest), ("chunkOffset", self.chunkOffset),
                ("chunkSize", self.chunkSize), ("chunkDigest", self.chunkDigest)]
        out.update((k, v) for k, v in tail if v)
        return out


@dataclass(frozen=True)
class ChunkRef:
    """Where one chunk of a file lives: compressed ``[offset, end)`` in the blob, uncompressed
    ``[chunk_offset, chunk_offset + chunk_size)`` in the file; ``inner_offset`` bytes of the
    decompressed member precede it (0 unless another writer packed small files together)."""

    offset: int
    end: int
    chunk_offset: int
    chunk_size: int
    digest: str
    inner_offset: int = 0


@dataclass(frozen=True)
class Toc:
    """A parsed, validated TOC; ``toc_offset`` is where the TOC's gzip member starts."""

    version: int
    entries: tuple[TocEntry, ...]
    toc_offset: int = 0
    _by_path: dict[str, TocEntry] = field(default_factory=dict, repr=False, compare=False)
    _chunks: dict[str, list[ChunkRef]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_path, chunks = _index(self.entries, self.toc_offset)
        object.__setattr__(self, "_by_path", by_path)
        object.__setattr__(self, "_chunks", chunks)

    def entry(self, name: str) -> TocEntry | None:
        """The (first-chunk) entry of ``name`` (cleaned), or None."""
        return self._by_path.get(clean_name(name))

    def files(self) -> list[TocEntry]:
        """Every non-chunk entry, in TOC order."""
        return [e for e in self.entries if e.type != "chunk"]

    def chunks_of(self, name: str) -> list[ChunkRef]:
        """The chunks of regular file ``name`` (hardlinks followed); [] for an empty file."""
        ent = self.entry(name)
        seen = 0
        while ent is not None and ent.type == "hardlink" and seen < 64:
            ent = self.entry(ent.linkName)
            seen += 1
        if ent is None or ent.type != "reg":
            raise KeyError(name)
        return list(self._chunks.get(ent.path, []))

    def chunk_map(self) -> Mapping[str, list[ChunkRef]]:
        """Every non-empty regular file's chunks, by cleaned path (hard links not repeated);
        read-only: the lists are the TOC's own."""
        return self._chunks

    def prefetch_end(self) -> int:
        """End of the prioritized prefix: the offset of ``.prefetch.landmark``, or 0."""
        ent = self.entry(PREFETCH_LANDMARK)
        return ent.offset if ent is not None else 0

    def encode(self) -> bytes:
        """The TOC JSON as the Go writer produces it (``json.MarshalIndent``, tab indent)."""
        doc = {"version": self.version, "entries": [e.to_json() for e in self.entries]}
        return json.dumps(doc, indent="\t", ensure_ascii=False).encode("utf-8")


def clean_name(name: str) -> str:
    """``./a/b/`` → ``a/b``; the root is ``""``."""
    if name[:2] != "./" and name[-1:] != "/" and name != ".":
        return name  # the common case: nothing to clean
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    return "" if name == "." else name


def check_name(name: str, what: str = "name") -> None:
    """Refuse names that could escape the root: absolute, ``..``, NUL, empty."""
    if not name or "\x00" in name:
        raise InvalidToc(f"TOC entry {what} {name!r} is empty or contains NUL")
    if name.startswith("/"):
        raise InvalidToc(f"TOC entry {what} {name!r} is absolute")
    if ".." in name.split("/"):
        raise InvalidToc(f"TOC entry {what} {name!r} contains '..'")


class _GcPause:
    """Who is inside ``gc_paused`` now, and whether collection was on before the first."""

    lock = threading.Lock()
    pausers = 0
    was_enabled = True


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (reference counting still frees).

    Parsing a large TOC and building its tree allocate ~100k long-lived objects (a Python
    package tree: 19,500 entries, a 7.6 MB TOC) and nothing cyclic; every allocation
    threshold crossed started a collection that walked the growing heap again: about half
    of ``parse_toc``'s CPU time (0.83-1.12 s → 0.38-0.59 s on the bench's TOC), on the
    path of a pod's first mount. Nestable and shared between threads (the daemon mounts an
    image's layers at once): collection resumes when the last pauser leaves, and only if it
    was enabled before the first came."""
    with _GcPause.lock:
        _GcPause.pausers += 1
        if _GcPause.pausers == 1:
            _GcPause.was_enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.pausers -= 1
            if _GcPause.pausers == 0 and _GcPause.was_enabled:
                gc.enable()


def parse_toc(data: bytes, blob_size: int, toc_offset: int | None = None) -> Toc:
    """Parse and validate TOC JSON of a blob of ``blob_size`` bytes whose TOC member starts at
    ``toc_offset`` (default: ``blob_size``, which only loosens the last chunks' extent)."""
    with gc_paused():
        return _parse_toc(data, blob_size, toc_offset)


def _parse_toc(data: bytes, blob_size: int, toc_offset: int | None) -> Toc:
    if len(data) > MAX_TOC_SIZE:
        raise InvalidToc(f"TOC is {len(data)} bytes, more than the {MAX_TOC_SIZE} allowed")
    limit = blob_size if toc_offset is None else toc_offset
    if not 0 <= limit <= blob_size:
        raise InvalidToc(f"TOC offset {toc_offset} is outside the blob ({blob_size} bytes)")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidToc(f"TOC is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != TOC_VERSION:
        raise InvalidToc("TOC is not an object with version 1")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise InvalidToc("TOC has no entries list")
    users: dict[int, str] = {}
    groups: dict[int, str] = {}
    entries = tuple(_entry_from_json(r, limit, users, groups) for r in raw)
    return Toc(version=TOC_VERSION, entries=entries, toc_offset=limit)


def _entry_from_json(raw: object, limit: int, users: dict[int, str] | None = None,
                     groups: dict[int, str] | None = None) -> TocEntry:
    """One validated entry; integers defaulted to 0, mode masked to permission bits.

    ``userName``/``groupName`` appear only on the first entry with that uid/gid: ``users``
    and ``groups`` carry them (by id) from entry to entry. Written for speed (a Python
    package tree is tens of thousands of entries, parsed while a pod waits for its mount):
    one dict lookup per field, no intermediate objects."""
    if not isinstance(raw, dict):
        raise InvalidToc("TOC entry is not an object")
    name, typ = raw.get("name"), raw.get("type")
    if not isinstance(name, str) or typ not in ENTRY_TYPES:
        raise InvalidToc(f"TOC entry {name!r} has a missing or unknown type {typ!r}")
    check_name(name)
    n: dict[str, int] = {}
    for key in _INT_FIELDS:
        value = raw.get(key)
        if value is None:
            n[key] = 0
        elif type(value) is int and value >= 0:  # not bool (an int subclass)
            n[key] = value
        else:
            raise InvalidToc(f"TOC entry {name!r}: {key} must be a non-negative integer")
    uid, gid = n["uid"], n["gid"]
    uname, gname = _str(raw, "userName", name), _str(raw, "groupName", name)
    if users is not None and groups is not None:
        if uname:
            users.setdefault(uid, uname)
        else:
            uname = users.get(uid, "")
        if gname:
            groups.setdefault(gid, gname)
        else:
            gname = groups.get(gid, "")
    xattrs = raw.get("xattrs")
    ent = TocEntry(
        name, str(typ), n["size"], _str(raw, "modtime", name), _str(raw, "linkName", name),
        n["mode"] & 0o7777, uid, gid, uname, gname, n["devMajor"], n["devMinor"],
        {} if xattrs is None else _xattrs(xattrs, name), _str(raw, "digest", name),
        n["offset"], n["innerOffset"], n["chunkOffset"], n["chunkSize"],
        _str(raw, "chunkDigest", name),
    )
    _check_entry(ent, limit)
    return ent


def _str(raw: dict[str, Any], key: str, name: str) -> str:
    value = raw.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidToc(f"TOC entry {name!r}: {key} must be a string")
    return value


def _xattrs(raw: object, name: str) -> dict[str, bytes]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidToc(f"TOC entry {name!r}: xattrs must be an object")
    out: dict[str, bytes] = {}
    for key, value in raw.items():
        if not isinstance(value, str):
            raise InvalidToc(f"TOC entry {name!r}: xattr {key!r} is not base64")
        try:
            out[str(key)] = base64.b64decode(value, validate=True)
        except binascii.Error:
            raise InvalidToc(f"TOC entry {name!r}: xattr {key!r} is not base64") from None
    return out


def _check_entry(ent: TocEntry, limit: int) -> None:
    """Per-entry rules: payload offsets inside the blob, digests well-formed, links safe."""
    where = f"TOC entry {ent.name!r}"
    for key in ("digest", "chunkDigest"):
        value = getattr(ent, key)
        if value and not _DIGEST_RE.match(value):
            raise InvalidToc(f"{where}: {key} {value!r} is not a sha256 digest")
    if ent.has_payload and not ent.offset < limit:
        raise InvalidToc(f"{where}: offset {ent.offset} is outside the blob's data ({limit})")
    if ent.type == "hardlink":
        check_name(ent.linkName, "linkName")
    if ent.type in ("reg", "chunk") and ent.chunkOffset + ent.chunkSize > _file_size(ent):
        raise InvalidToc(f"{where}: chunk [{ent.chunkOffset}, +{ent.chunkSize}) past the size")


def _file_size(ent: TocEntry) -> int:
    """Chunk entries may omit ``size``; then only their own extent bounds them."""
    if ent.type == "chunk" and ent.size == 0:
        return ent.chunkOffset + ent.chunkSize
    return ent.size


def _index(
    entries: tuple[TocEntry, ...], toc_offset: int
) -> tuple[dict[str, TocEntry], dict[str, list[ChunkRef]]]:
    """Index entries by path and compute each file's chunk extents.

    A chunk's compressed bytes end where the next entry with a (different) offset begins;
    the last ones end at the TOC. Offsets must not go backwards, chunks must tile the file,
    and every payload must carry a digest, so nothing unverified can ever be served.
    """
    by_path: dict[str, TocEntry] = {}
    order: list[tuple[str, TocEntry]] = []
    for ent in entries:
        path, kind = clean_name(ent.name), ent.type
        if kind == "chunk":
            head = by_path.get(path)
            if head is None or head.type != "reg":
                raise InvalidToc(f"TOC chunk {ent.name!r} has no regular file before it")
            order.append((path, ent))
            continue
        if path in by_path and path != "":
            raise InvalidToc(f"TOC has two entries named {ent.name!r}")
        by_path[path] = ent
        if kind == "reg" and ent.size > 0:  # has_payload
            order.append((path, ent))
    _check_links(by_path)
    return by_path, _chunk_extents(order, by_path, toc_offset)


def _check_links(by_path: dict[str, TocEntry]) -> None:
    for ent in by_path.values():
        if ent.type == "hardlink" and clean_name(ent.linkName) not in by_path:
            raise InvalidToc(f"TOC hardlink {ent.name!r} points to missing {ent.linkName!r}")


def _chunk_extents(
    order: list[tuple[str, TocEntry]], by_path: dict[str, TocEntry], toc_offset: int
) -> dict[str, list[ChunkRef]]:
    """Each file's chunks, checked: extents never backwards, chunks tiling the file, a
    digest for every one. One pass (the next offset of each payload comes from a backward
    pass first: scanning forward from every entry was quadratic in the TOC's length)."""
    ends = _next_offsets(order, toc_offset)
    pending: dict[str, list[tuple[TocEntry, int, int]]] = {}
    for (path, ent), end in zip(order, ends, strict=True):
        if end < ent.offset:
            raise InvalidToc(f"TOC entry {ent.name!r}: offsets go backwards")
        size = by_path[path].size
        refs = pending.get(path)
        if refs is None:
            refs = pending[path] = []
        expected = refs[-1][0].chunkOffset + refs[-1][2] if refs else 0
        if ent.chunkOffset != expected:
            raise InvalidToc(f"TOC entry {ent.name!r}: chunks do not tile the file")
        length = ent.chunkSize or size - ent.chunkOffset
        if length <= 0 or ent.chunkOffset + length > size:
            raise InvalidToc(f"TOC entry {ent.name!r}: chunk size is outside the file")
        refs.append((ent, end, length))
    return {p: _with_digests(refs, by_path[p]) for p, refs in pending.items()}


def _next_offsets(order: list[tuple[str, TocEntry]], toc_offset: int) -> list[int]:
    """For each payload, the offset of the first later payload that starts elsewhere (where
    its compressed bytes end); the TOC's offset for the last ones."""
    ends = [toc_offset] * len(order)
    for i in range(len(order) - 2, -1, -1):
        later = order[i + 1][1].offset
        ends[i] = later if later != order[i][1].offset else ends[i + 1]
    return ends


def _with_digests(refs: list[tuple[TocEntry, int, int]], head: TocEntry) -> list[ChunkRef]:
    """Attach each chunk's digest; a whole-file ``digest`` may stand in for an unchunked file."""
    last, _, last_size = refs[-1]
    if last.chunkOffset + last_size != head.size:
        raise InvalidToc(f"TOC file {head.name!r}: chunks do not cover its size")
    single = len(refs) == 1
    out = []
    for ent, end, length in refs:
        digest = ent.chunkDigest or (head.digest if single else "")
        if not digest:
            raise InvalidToc(f"TOC entry {ent.name!r} has no chunkDigest; it cannot be verified")
        out.append(ChunkRef(ent.offset, end, ent.chunkOffset, length, digest, ent.innerOffset))
    return out
