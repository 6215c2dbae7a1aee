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
import dataclasses
import gc
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

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

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")
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

    @cached_property
    def path(self) -> str:
        """The name cleaned for lookups: no ``./`` prefix, no trailing ``/`` (computed once:
        the index, the tree and the reads all look entries up by it)."""
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


class ChunkRef(NamedTuple):
    """Where one chunk of a file lives: compressed ``[offset, end)`` in the blob, uncompressed
    ``[chunk_offset, chunk_offset + chunk_size)`` in the file; ``inner_offset`` bytes of the
    decompressed member precede it (0 unless another writer packed small files together).
    A named tuple: a large TOC makes one per file, and a frozen dataclass cost 3 times as
    much to build (2.2 µs against 0.8)."""

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
    if name and name[-1] != "/" and name[0] != ".":
        return name  # the common case: nothing to clean (single characters: no copies)
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
    if ".." in name and ".." in name.split("/"):
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
    entries = tuple([_entry_from_json(r, limit, users, groups) for r in raw])
    _check_digests(entries)
    return Toc(version=TOC_VERSION, entries=entries, toc_offset=limit)


_KEYS: dict[str, tuple[str, type[Any]]] = {
    **{key: (key, int) for key in _INT_FIELDS},
    "name": ("name", str), "type": ("type", str), "modtime": ("modtime", str),
    "linkName": ("linkName", str), "userName": ("uname", str), "groupName": ("gname", str),
    "digest": ("digest", str), "chunkDigest": ("chunkDigest", str),
}
"""JSON key → (``TocEntry`` field, the one JSON type its value may have). ``xattrs`` is
decoded apart; other keys (``NumLink``, newer writers' fields) are ignored."""

_DEFAULTS: dict[str, Any] = {  # name and type have none: "" (refused if still so)
    f.name: "" if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(TocEntry) if f.name != "xattrs"}


def _entry_from_json(raw: object, limit: int, users: dict[int, str],
                     groups: dict[int, str]) -> TocEntry:
    """One validated entry (digests are checked for all entries at once, ``_check_digests``);
    integers defaulted to 0, mode masked to permission bits.

    ``userName``/``groupName`` appear only on the first entry with that uid/gid: ``users``
    and ``groups`` carry them (by id) from entry to entry. Written for speed (a Python
    package tree is tens of thousands of entries, parsed while a pod waits for its mount):
    see ``_values``."""
    if type(raw) is not dict:
        raise InvalidToc("TOC entry is not an object")
    values = _values(raw)
    name, typ = values["name"], values["type"]
    if typ not in ENTRY_TYPES:
        raise InvalidToc(f"TOC entry {name!r} has a missing or unknown type {typ!r}")
    check_name(name)
    values["path"] = clean_name(name)  # TocEntry.path, a cached property
    values["mode"] &= 0o7777
    _owner_names(values, users, groups)
    xattrs = raw.get("xattrs")
    values["xattrs"] = {} if xattrs is None else _xattrs(xattrs, name)
    _check_entry(values, limit)
    return _make_entry(values)


def _values(raw: dict[str, Any]) -> dict[str, Any]:
    """The entry's fields: a copy of the defaults, filled key by key from the JSON object
    (one pass over the keys it has; a null is the default, unknown keys are ignored)."""
    values = _DEFAULTS.copy()
    for key, value in raw.items():
        spec = _KEYS.get(key)
        if spec is None or value is None:
            continue  # an unknown key, or null: the default
        attr, kind = spec
        if type(value) is not kind or (kind is int and value < 0):
            raise InvalidToc(f"TOC entry {raw.get('name')!r}: {key} must be a "
                             + ("non-negative integer" if kind is int else "string"))
        values[attr] = value
    return values


def _owner_names(values: dict[str, Any], users: dict[int, str],
                 groups: dict[int, str]) -> None:
    if values["uname"]:
        users.setdefault(values["uid"], values["uname"])
    elif users:
        values["uname"] = users.get(values["uid"], "")
    if values["gname"]:
        groups.setdefault(values["gid"], values["gname"])
    elif groups:
        values["gname"] = groups.get(values["gid"], "")


def _make_entry(values: dict[str, Any]) -> TocEntry:
    """A ``TocEntry`` from a dict of all its fields (checked by the caller), bypassing the
    generated ``__init__``: a frozen dataclass sets each of its 19 fields through
    ``object.__setattr__``, which was a sizeable part of parsing a large TOC."""
    ent: TocEntry = object.__new__(TocEntry)
    object.__setattr__(ent, "__dict__", values)
    return ent


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


def _check_entry(values: dict[str, Any], limit: int) -> None:
    """Per-entry rules: payload offsets inside the blob, links safe, chunks in the file."""
    typ = values["type"]
    if typ == "reg" or typ == "chunk":
        if (typ == "chunk" or values["size"] > 0) and not values["offset"] < limit:
            raise InvalidToc(f"TOC entry {values['name']!r}: offset {values['offset']} is "
                             f"outside the blob's data ({limit})")
        end = values["chunkOffset"] + values["chunkSize"]
        size = values["size"] if typ == "reg" or values["size"] else end  # chunks may omit it
        if end > size:
            raise InvalidToc(f"TOC entry {values['name']!r}: chunk [{values['chunkOffset']}, "
                             f"+{values['chunkSize']}) past the size")
    elif typ == "hardlink":
        check_name(values["linkName"], "linkName")


_DIGEST_LINES = re.compile(r"(?:sha256:[0-9a-f]{64}\n)*")


def _check_digests(entries: tuple[TocEntry, ...]) -> None:
    """Every ``digest`` and ``chunkDigest`` is a sha256 digest: one regular expression over
    all of them (a match per digest cost more than the rest of an entry's checks); the
    length check makes sure no value held a line break of its own."""
    digests = [d for e in entries for d in (e.digest, e.chunkDigest) if d]
    joined = "\n".join(digests) + "\n"
    if len(joined) == 72 * len(digests) and _DIGEST_LINES.fullmatch(joined):
        return
    for ent in entries:
        for key, value in (("digest", ent.digest), ("chunkDigest", ent.chunkDigest)):
            if value and not _DIGEST_RE.match(value):
                raise InvalidToc(f"TOC entry {ent.name!r}: {key} {value!r} is not a sha256 "
                                 "digest")
    raise InvalidToc("TOC has a digest that is not a sha256 digest")  # pragma: no cover


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
        path, kind = ent.path, ent.type
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
    pass first: scanning forward from every entry was quadratic in the TOC's length), then
    one over the files (``_check_files``)."""
    ends = _next_offsets(order, toc_offset)
    out: dict[str, list[ChunkRef]] = {}
    for (path, ent), end in zip(order, ends, strict=True):
        offset, chunk_offset = ent.offset, ent.chunkOffset
        if end < offset:
            raise InvalidToc(f"TOC entry {ent.name!r}: offsets go backwards")
        size = by_path[path].size
        refs = out.get(path)
        if refs is None:
            refs = out[path] = []
            expected = 0
        else:
            expected = refs[-1].chunk_offset + refs[-1].chunk_size
        if chunk_offset != expected:
            raise InvalidToc(f"TOC entry {ent.name!r}: chunks do not tile the file")
        length = ent.chunkSize or size - chunk_offset
        if length <= 0 or chunk_offset + length > size:
            raise InvalidToc(f"TOC entry {ent.name!r}: chunk size is outside the file")
        refs.append(ChunkRef(offset, end, chunk_offset, length, ent.chunkDigest,
                             ent.innerOffset))
    _check_files(out, by_path)
    return out


def _next_offsets(order: list[tuple[str, TocEntry]], toc_offset: int) -> list[int]:
    """For each payload, the offset of the first later payload that starts elsewhere (where
    its compressed bytes end); the TOC's offset for the last ones."""
    ends = [toc_offset] * len(order)
    for i in range(len(order) - 2, -1, -1):
        later = order[i + 1][1].offset
        ends[i] = later if later != order[i][1].offset else ends[i + 1]
    return ends


def _check_files(chunks: dict[str, list[ChunkRef]], by_path: dict[str, TocEntry]) -> None:
    """Each file's chunks cover its size, and each has a digest: its ``chunkDigest``, or
    for an unchunked file the whole-file ``digest`` standing in (put in place here)."""
    for path, refs in chunks.items():
        head = by_path[path]
        last = refs[-1]
        if last.chunk_offset + last.chunk_size != head.size:
            raise InvalidToc(f"TOC file {head.name!r}: chunks do not cover its size")
        if len(refs) == 1 and not last.digest and head.digest:
            refs[0] = last._replace(digest=head.digest)
        for ref in refs:
            if not ref.digest:
                raise InvalidToc(f"TOC entry {head.name!r} (chunk at {ref.chunk_offset}) has "
                                 "no chunkDigest; it cannot be verified")
