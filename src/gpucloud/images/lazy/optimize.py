"""``gpucloud image optimize``: convert an image to eStargz, optionally ordered by a recorded
start, and push it to a registry (or write it as an OCI layout directory).

A source or destination that starts with ``/``, ``./`` or ``../`` is an OCI image layout
directory; anything else is an image reference. The result is always an OCI manifest (the
layer annotations carry the TOC digests; Docker schema 2 would drop them) for this host's
platform, whose config has the new ``rootfs.diff_ids`` (an eStargz layer's uncompressed tar
holds the TOC and a landmark, so it differs from the original's). Every input blob is
verified against its digest and every layer against its diff_id before it is converted.

With a recording, each recorded path is prioritized in the topmost layer that has it (the
one that supplies the file at run time); layers with none get ``.no.prefetch.landmark``.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucloud.images.client import RegistryClient, sha256_digest
from gpucloud.images.errors import DigestMismatch, InvalidImage
from gpucloud.images.lazy.estargz import DEFAULT_LEVEL, ConvertedLayer, convert_layer
from gpucloud.images.lazy.record import Recording, RecordOptions, record
from gpucloud.images.lazy.toc import (
    DEFAULT_CHUNK_SIZE,
    TOC_DIGEST_ANNOTATION,
    UNCOMPRESSED_SIZE_ANNOTATION,
    clean_name,
)
from gpucloud.images.manifest import (
    INDEX_TYPES,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Descriptor,
    Index,
    Manifest,
    host_platform,
    load_json,
    parse_manifest_or_index,
    select_platform,
)
from gpucloud.images.reference import ImageReference, parse_reference
from gpucloud.images.rootfs import mount_overlay, unmount
from gpucloud.images.store import digest_hex
from gpucloud.images.unpack import Whiteouts, open_decompressed, unpack_layer

_COPY = 1 << 20


@dataclass(frozen=True)
class OptimizeOptions:
    level: int = DEFAULT_LEVEL
    chunk_size: int = DEFAULT_CHUNK_SIZE
    record: RecordOptions | None = None
    #: Paths to prioritize as well (after recorded ones), e.g. a saved recording.
    prefetch: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizedImage:
    manifest_digest: str
    manifest: bytes
    config: bytes
    layers: tuple[ConvertedLayer, ...]
    prioritized: tuple[tuple[str, ...], ...]
    recording: Recording | None = None


@dataclass
class _Source:
    """An image to read: manifest, config bytes and a way to fetch each blob (verified)."""

    manifest: Manifest
    config: bytes
    fetch: Callable[[Descriptor, Path], None]
    layer_paths: list[Path] = field(default_factory=list)


def is_layout_path(text: str) -> bool:
    """True when ``text`` names an OCI layout directory rather than an image reference."""
    return text.startswith(("/", "./", "../")) or text in (".", "..")


def optimize(src: str, dst: str, options: OptimizeOptions, client: RegistryClient,
             workdir: Path | None = None) -> OptimizedImage:
    """Convert ``src`` into eStargz and write it to ``dst``."""
    with ExitStack() as stack:
        work = workdir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="gpucloud-optimize-", dir="/var/tmp")))
        source = _open_source(src, client)
        tars = _fetch_layers(source, work)
        recording = _record(source, tars, work, options.record) if options.record else None
        wanted = [*(recording.paths if recording else ()), *options.prefetch]
        plan = _assign(wanted, tars) if (recording or options.prefetch) else [[] for _ in tars]
        converted = [_convert(t, work / "out" / f"{i}.esgz", p, options)
                     for i, (t, p) in enumerate(zip(tars, plan, strict=True))]
        image = _image(source.config, converted, plan, recording)
        _write(dst, image, work, client)
        return image


# -- sources ---------------------------------------------------------------------------


def _open_source(src: str, client: RegistryClient) -> _Source:
    return _layout_source(Path(src)) if is_layout_path(src) else _registry_source(
        parse_reference(src), client)


def _registry_source(ref: ImageReference, client: RegistryClient) -> _Source:
    fetched = client.get_manifest(ref)
    parsed = parse_manifest_or_index(fetched.data, fetched.media_type)
    if isinstance(parsed, Index):
        chosen = select_platform(parsed, str(ref), host_platform())
        fetched = client.get_manifest(ref, chosen.digest)
        parsed = parse_manifest_or_index(fetched.data, fetched.media_type)
    if not isinstance(parsed, Manifest):
        raise InvalidImage(f"{ref} does not resolve to an image manifest")

    def fetch(desc: Descriptor, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with dest.open("w+b") as sink:
            client.fetch_blob(ref, desc, sink)

    config = io.BytesIO()
    client.fetch_blob(ref, parsed.config, config)
    return _Source(parsed, config.getvalue(), fetch)


def _layout_source(root: Path) -> _Source:
    if not (root / "oci-layout").is_file() or not (root / "index.json").is_file():
        raise InvalidImage(f"{root} is not an OCI image layout (no oci-layout or index.json)")

    def blob(desc: Descriptor) -> Path:
        return root / "blobs" / "sha256" / digest_hex(desc.digest)

    def fetch(desc: Descriptor, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _copy_verified(blob(desc), dest, desc)

    index = parse_manifest_or_index((root / "index.json").read_bytes())
    desc = _pick(index, str(root))
    while desc.media_type in INDEX_TYPES:
        desc = _pick(parse_manifest_or_index(_read_verified(blob(desc), desc)), str(root))
    manifest = parse_manifest_or_index(_read_verified(blob(desc), desc), desc.media_type)
    if not isinstance(manifest, Manifest):
        raise InvalidImage(f"{root}: {desc.digest} is not an image manifest")
    return _Source(manifest, _read_verified(blob(manifest.config), manifest.config), fetch)


def _pick(index: Manifest | Index, label: str) -> Descriptor:
    if not isinstance(index, Index):
        raise InvalidImage(f"{label}: index.json is not an image index")
    if len(index.manifests) == 1:
        return index.manifests[0]
    return select_platform(index, label, host_platform())


def _read_verified(path: Path, desc: Descriptor) -> bytes:
    data = path.read_bytes()
    if sha256_digest(data) != desc.digest:
        raise DigestMismatch(desc.digest, f"{path} hashed to {sha256_digest(data)}")
    return data


def _copy_verified(src: Path, dest: Path, desc: Descriptor) -> None:
    hasher = hashlib.sha256()
    try:
        with src.open("rb") as fin, dest.open("wb") as fout:
            while block := fin.read(_COPY):
                hasher.update(block)
                fout.write(block)
    except FileNotFoundError:
        raise InvalidImage(f"OCI layout has no blob {desc.digest}") from None
    if "sha256:" + hasher.hexdigest() != desc.digest:
        raise DigestMismatch(desc.digest, f"its content hashed to sha256:{hasher.hexdigest()}")


def _fetch_layers(source: _Source, work: Path) -> list[Path]:
    """Fetch and decompress every layer, checking each against the config's diff_ids."""
    diff_ids = list(load_json(source.config, "image config").get("rootfs", {})
                    .get("diff_ids") or [])
    if len(diff_ids) != len(source.manifest.layers):
        raise InvalidImage("image config's diff_ids do not match the manifest's layers")
    tars = []
    for i, desc in enumerate(source.manifest.layers):
        blob = work / "blobs" / f"{i}"
        source.fetch(desc, blob)
        tar = work / "tars" / f"{i}.tar"
        _decompress(blob, tar, str(diff_ids[i]))
        blob.unlink()
        tars.append(tar)
    return tars


def _decompress(blob: Path, tar: Path, diff_id: str) -> None:
    tar.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    with open_decompressed(blob) as stream, tar.open("wb") as out:
        while block := stream.read(_COPY):
            hasher.update(block)
            out.write(block)
    if "sha256:" + hasher.hexdigest() != diff_id:
        raise DigestMismatch(diff_id, f"the layer decompressed to sha256:{hasher.hexdigest()}",
                             "layer")


# -- recording and planning -------------------------------------------------------------


def _record(source: _Source, tars: list[Path], work: Path, options: RecordOptions) -> Recording:
    """Unpack the original layers, overlay them and record the start in a container."""
    lowers = []
    for i, tar in enumerate(tars):
        dest = work / "layers" / str(i)
        dest.mkdir(parents=True)
        unpack_layer(tar, dest, Whiteouts.OVERLAY)
        lowers.append(dest)
    rootfs, upper, scratch = work / "rootfs", work / "upper", work / "ovl-work"
    for d in (rootfs, upper, scratch):
        d.mkdir()
    mount_overlay(list(reversed(lowers)), upper, scratch, rootfs)
    try:
        return record(rootfs, load_json(source.config, "image config"), options, work)
    finally:
        unmount(rootfs)
        shutil.rmtree(work / "layers", ignore_errors=True)


def _assign(paths: Sequence[str], tars: list[Path]) -> list[list[str]]:
    """Each path goes to the topmost layer that has an entry for it."""
    names = [_layer_names(t) for t in tars]
    plan: list[list[str]] = [[] for _ in tars]
    for path in dict.fromkeys(paths):
        name = clean_name(path.lstrip("/"))
        for i in reversed(range(len(tars))):
            if name in names[i]:
                plan[i].append(name)
                break
    return plan


def _layer_names(tar: Path) -> set[str]:
    with tarfile.open(tar, "r:") as t:
        return {clean_name(n) for n in t.getnames()}


def _convert(tar: Path, out: Path, prioritized: list[str],
             options: OptimizeOptions) -> ConvertedLayer:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        layer = convert_layer(tar, f, prioritized=prioritized, chunk_size=options.chunk_size,
                              level=options.level)
    tar.unlink()
    return layer


# -- the result --------------------------------------------------------------------------


def _image(config: bytes, layers: list[ConvertedLayer], plan: list[list[str]],
           recording: Recording | None) -> OptimizedImage:
    doc = load_json(config, "image config")
    doc.setdefault("rootfs", {"type": "layers"})["diff_ids"] = [c.diff_id for c in layers]
    new_config = json.dumps(doc, indent=2).encode()
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": sha256_digest(new_config),
                   "size": len(new_config)},
        "layers": [_layer_descriptor(c) for c in layers],
    }
    data = json.dumps(manifest, indent=2).encode()
    return OptimizedImage(sha256_digest(data), data, new_config, tuple(layers),
                          tuple(tuple(p) for p in plan), recording)


def _layer_descriptor(layer: ConvertedLayer) -> dict[str, Any]:
    return {"mediaType": OCI_LAYER_GZIP, "digest": layer.digest, "size": layer.size,
            "annotations": {TOC_DIGEST_ANNOTATION: layer.toc_digest,
                            UNCOMPRESSED_SIZE_ANNOTATION: str(layer.uncompressed_size)}}


def _write(dst: str, image: OptimizedImage, work: Path, client: RegistryClient) -> None:
    blobs: dict[str, Path | bytes] = {sha256_digest(image.config): image.config}
    for i, layer in enumerate(image.layers):
        blobs[layer.digest] = work / "out" / f"{i}.esgz"
    if is_layout_path(dst):
        _write_layout(Path(dst), image, blobs)
    else:
        _push(parse_reference(dst), image, blobs, client)


def _push(ref: ImageReference, image: OptimizedImage, blobs: dict[str, Path | bytes],
          client: RegistryClient) -> None:
    if ref.digest:
        raise InvalidImage(f"destination {ref} must be a tag, not a digest")
    for digest, source in blobs.items():
        if not client.blob_exists(ref.api_registry, ref.repository, digest):
            client.upload_blob(ref.api_registry, ref.repository, source, digest)
    client.put_manifest(ref.api_registry, ref.repository, ref.tag or "latest", image.manifest,
                        OCI_MANIFEST)


def _write_layout(root: Path, image: OptimizedImage, blobs: dict[str, Path | bytes]) -> None:
    """An OCI layout holding this one image (blobs added to an existing layout's)."""
    blob_dir = root / "blobs" / "sha256"
    blob_dir.mkdir(parents=True, exist_ok=True)
    for digest, source in {**blobs, image.manifest_digest: image.manifest}.items():
        target = blob_dir / digest_hex(digest)
        if isinstance(source, bytes):
            target.write_bytes(source)
        else:
            shutil.copyfile(source, target)
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    entry = {"mediaType": OCI_MANIFEST, "digest": image.manifest_digest,
             "size": len(image.manifest)}
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}
    (root / "index.json").write_text(json.dumps(index, indent=2))
