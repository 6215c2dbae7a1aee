"""The eStargz footer: an empty gzip member whose extra field holds the TOC's offset.

Layout of the 51-byte footer (``estargz/gzip.go``)::

    1f 8b 08 04 00000000 00 ff      gzip header, FLG=FEXTRA, OS=255
    1a 00                           XLEN = 26
    'S' 'G' 16 00                   subfield id "SG", LEN = 22
    "%016x" % toc_offset "STARGZ"   22 bytes
    01 00 00 ff ff                  an empty stored deflate block
    00000000 00000000               CRC32 and ISIZE of nothing

The legacy (CRFS stargz) footer is 47 bytes: XLEN = 22 and the 22 bytes raw, no subfield
header. Readers accept both; writers write only the 51-byte one. The external-TOC variant
(subfield ``...STARGZEXTERNALTOC``, TOC in a separate image) is recognised and refused with
:class:`ExternalToc` so that callers fall back to a full pull.
"""

from __future__ import annotations

import struct
import zlib

from gpucloud.images.lazy.toc import InvalidToc

FOOTER_SIZE = 51
LEGACY_FOOTER_SIZE = 47
_MAGIC = "STARGZ"
_EXTERNAL_MAGIC = b"STARGZEXTERNALTOC"
_GZIP_HEAD = b"\x1f\x8b\x08\x04\x00\x00\x00\x00\x00\xff"
_EMPTY_DEFLATE_TAIL = b"\x01\x00\x00\xff\xff" + b"\x00" * 8


class ExternalToc(InvalidToc):
    """The layer keeps its TOC in a separate image; lazy mounting is not supported for it."""

    reason = "ExternalToc"


def footer_bytes(toc_offset: int) -> bytes:
    """The 51-byte footer pointing at ``toc_offset``."""
    payload = f"{toc_offset:016x}{_MAGIC}".encode("ascii")
    extra = b"SG" + struct.pack("<H", len(payload)) + payload
    out = _GZIP_HEAD + struct.pack("<H", len(extra)) + extra + _EMPTY_DEFLATE_TAIL
    assert len(out) == FOOTER_SIZE
    return out


def parse_footer(tail: bytes) -> int:
    """The TOC offset from the last bytes of a blob (at least 47 of them; 51 or more to
    recognise the current footer). Raises :class:`InvalidToc` for anything else."""
    return parse_footer_sized(tail)[0]


def parse_footer_sized(tail: bytes) -> tuple[int, int]:
    """(TOC offset, the footer's own size: 51, or 47 for the legacy one) from the last
    bytes of a blob: the TOC's gzip member ends where the footer begins."""
    if _EXTERNAL_MAGIC in tail[-64:]:
        raise ExternalToc("layer has an external TOC (STARGZEXTERNALTOC); not supported lazily")
    if len(tail) >= FOOTER_SIZE:
        offset = _parse_current(tail[-FOOTER_SIZE:])
        if offset is not None:
            return offset, FOOTER_SIZE
    if len(tail) >= LEGACY_FOOTER_SIZE:
        offset = _parse_legacy(tail[-LEGACY_FOOTER_SIZE:])
        if offset is not None:
            return offset, LEGACY_FOOTER_SIZE
    if len(tail) < LEGACY_FOOTER_SIZE:
        raise InvalidToc(f"eStargz footer is truncated ({len(tail)} bytes)")
    raise InvalidToc("blob does not end with an eStargz footer")


def _parse_current(footer: bytes) -> int | None:
    if footer[:10] != _GZIP_HEAD or footer[10:16] != b"\x1a\x00SG\x16\x00":
        return None
    return _offset_field(footer[16:38], footer)


def _parse_legacy(footer: bytes) -> int | None:
    if footer[:10] != _GZIP_HEAD or footer[10:12] != b"\x16\x00":
        return None
    return _offset_field(footer[12:34], footer)


def _offset_field(field: bytes, footer: bytes) -> int | None:
    """Decode ``%016x`` + ``STARGZ`` and check the footer is a complete, empty gzip member."""
    hexpart, magic = field[:16], field[16:]
    if magic != _MAGIC.encode() or not all(c in b"0123456789abcdefABCDEF" for c in hexpart):
        return None
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = d.decompress(footer) + d.flush()
    except zlib.error:
        return None
    if data or not d.eof or d.unused_data:
        return None
    return int(hexpart, 16)
