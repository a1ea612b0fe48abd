"""Image sources: what a ref names, its digest and config, and an OCI layout umoci can read.

Four kinds of ref (`identify`):

- a directory holding `oci-layout`: an OCI image layout;
- any other directory: a root file system, used in place (nothing to unpack);
- a regular file: a tar archive, either an OCI layout in a tar (`oci-archive`,
  also what `docker save` writes since Docker 25) or the older `docker save`
  format (`manifest.json` with `<id>.json` configs and `<dir>/layer.tar` layers);
- a SIF file (Apptainer, SingularityCE): its squashfs system partition (`_sif`).

Archives are not unpacked here: `stage_layout` copies the layout's files (or, for
the older docker format, converts it: the layers become blobs named by their
digest, a manifest and an index are written) into a staging directory, checking
every blob's digest, and `umoci unpack --rootless` applies the layers
(whiteouts, opaque directories, hard links, unsafe paths; see cache.py). Member
names are checked before anything is written: only `oci-layout`, `index.json`,
`blobs/<algorithm>/<hex>` (and, for docker archives, the files manifest.json
names) are read, only as regular files; anything else in the archive is
ignored, a member with an unsafe name is refused.

Everything that cannot be read raises `SandboxImageError` naming the ref.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from treadle.errors import SandboxImageError
from treadle.sandbox.images._sif import is_sif, read_sif

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
_DIGEST = re.compile(r"(sha256|sha512):([0-9a-f]{64}|[0-9a-f]{128})\Z")
_BLOB_NAME = re.compile(r"blobs/(sha256|sha512)/([0-9a-f]+)\Z")
_CHUNK = 1 << 20
_JSON_LIMIT = 16 << 20  # index, manifest, config: far smaller than this
REF_NAME = "treadle"  # the tag the staged index gives the chosen manifest


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """What a sandbox takes from an image's config (`config` of the OCI image config)."""

    env: tuple[tuple[str, str], ...] = ()
    working_dir: str | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """One identified ref: its kind, and (for images) the digest the cache keys it by."""

    ref: str  # the absolute path
    kind: str  # "rootfs" | "oci-layout" | "oci-archive" | "docker-archive" | "sif"
    # "sha256:<hex>": the manifest's; for docker-archive the config's; for sif its
    # header's and descriptors' (`_sif`); rootfs: None
    digest: str | None


def identify(ref: str) -> Source:
    """What `ref` names, and its digest; SandboxImageError if it is none of the kinds."""
    path = os.path.abspath(ref)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "oci-layout")):
            index = _read_json(path, lambda: _read_path(os.path.join(path, "index.json")),
                               "index.json")
            return Source(path, "oci-layout", _pick_manifest(path, index)["digest"])
        if not any(os.path.isdir(os.path.join(path, d)) for d in ("usr", "bin")):
            raise SandboxImageError(f"image {ref}: a directory that is neither an OCI image "
                                    "layout (no oci-layout file) nor a root file system (no "
                                    "usr or bin directory)")
        return Source(path, "rootfs", None)
    if not os.path.exists(path):
        raise SandboxImageError(f"image {ref}: no such file or directory")
    if is_sif(path):
        return Source(path, "sif", read_sif(path).digest)
    with _open_tar(path) as tar:
        members = _members(path, tar)
        if "index.json" in members and "oci-layout" in members:
            index = _read_json(path, lambda: _read_member(path, tar, members, "index.json"),
                               "index.json")
            return Source(path, "oci-archive", _pick_manifest(path, index)["digest"])
        if "manifest.json" in members:
            entry = _docker_entry(path, tar, members)
            config = _read_member(path, tar, members, entry["Config"])
            return Source(path, "docker-archive", "sha256:" + hashlib.sha256(config).hexdigest())
    raise SandboxImageError(f"image {ref}: a tar archive without index.json and oci-layout "
                            "(OCI) or manifest.json (docker save)")


def stage_layout(source: Source, into: str) -> None:
    """Write at `into` (an empty directory) an OCI layout umoci can unpack: the
    source's manifest tagged `REF_NAME`, every blob present and checked."""
    os.makedirs(os.path.join(into, "blobs"), exist_ok=True)
    if source.kind == "oci-layout":
        # The blobs stay where they are (umoci only reads them); index.json is ours.
        os.rmdir(os.path.join(into, "blobs"))
        os.symlink(os.path.join(source.ref, "blobs"), os.path.join(into, "blobs"))
        index = _read_json(source.ref, lambda: _read_path(os.path.join(source.ref,
                                                                       "index.json")), "index.json")
        _write_index(into, _pick_manifest(source.ref, index))
        return
    with _open_tar(source.ref) as tar:
        members = _members(source.ref, tar)
        if source.kind == "oci-archive":
            for name, member in members.items():
                match = _BLOB_NAME.match(name)
                if match:
                    _copy_blob(source.ref, tar, member, into, f"{match[1]}:{match[2]}")
            index = _read_json(source.ref,
                               lambda: _read_member(source.ref, tar, members, "index.json"),
                               "index.json")
            _write_index(into, _pick_manifest(source.ref, index))
        else:
            _convert_docker(source.ref, tar, members, into)


def read_config(layout: str, ref: str) -> tuple[str, ImageConfig]:
    """The staged layout's manifest digest and image config (Env, WorkingDir, User)."""
    index = _read_json(ref, lambda: _read_path(os.path.join(layout, "index.json")), "index.json")
    descriptor = _pick_manifest(ref, index)
    manifest = _read_json(ref, lambda: _read_path(_blob_path(layout, descriptor["digest"])),
                          "the manifest")
    config_digest = (manifest.get("config") or {}).get("digest")
    if not isinstance(config_digest, str) or not _DIGEST.match(config_digest):
        raise SandboxImageError(f"image {ref}: the manifest names no valid config digest")
    config = _read_json(ref, lambda: _read_path(_blob_path(layout, config_digest)), "the config")
    return descriptor["digest"], parse_config(ref, config)


def parse_config(ref: str, config: dict[str, Any]) -> ImageConfig:
    """`config.Env`, `config.WorkingDir` and `config.User` of an OCI/docker image config."""
    body = config.get("config") or {}
    if not isinstance(body, dict):
        raise SandboxImageError(f"image {ref}: its config's 'config' is not an object")
    env: list[tuple[str, str]] = []
    for item in body.get("Env") or []:
        if not isinstance(item, str) or "=" not in item or "\x00" in item:
            raise SandboxImageError(f"image {ref}: bad Env entry {item!r} in its config")
        key, _, value = item.partition("=")
        env.append((key, value))
    working_dir = body.get("WorkingDir") or None
    if working_dir is not None and (not isinstance(working_dir, str)
                                    or not working_dir.startswith("/")):
        raise SandboxImageError(f"image {ref}: WorkingDir {working_dir!r} is not absolute")
    user = body.get("User") or None
    return ImageConfig(env=tuple(env), working_dir=working_dir and os.path.normpath(working_dir),
                       user=user if isinstance(user, str) else None)


# -- helpers ------------------------------------------------------------------


def _open_tar(path: str) -> tarfile.TarFile:
    try:
        return tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise SandboxImageError(f"image {path}: not a readable tar archive ({e})") from e


def _members(ref: str, tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """The archive's regular files by normalised name; unsafe names refused."""
    out: dict[str, tarfile.TarInfo] = {}
    try:
        infos = tar.getmembers()
    except (OSError, tarfile.TarError) as e:
        raise SandboxImageError(f"image {ref}: corrupt tar archive ({e})") from e
    for info in infos:
        name = info.name[2:] if info.name.startswith("./") else info.name
        if name in (".", ""):
            continue
        if name.startswith("/") or ".." in name.split("/"):
            raise SandboxImageError(f"image {ref}: unsafe member name {info.name!r}")
        if info.isreg():
            out[name.rstrip("/")] = info
    return out


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    stream = tar.extractfile(member)
    assert stream is not None  # regular files only (see _members)
    return stream


def _read_member(ref: str, tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo],
                 name: str, limit: int = _JSON_LIMIT) -> bytes:
    member = members.get(os.path.normpath(name))
    if member is None:
        raise SandboxImageError(f"image {ref}: the archive lacks {name!r}")
    if member.size > limit:
        raise SandboxImageError(f"image {ref}: {name!r} is implausibly large ({member.size} B)")
    return _extract(tar, member).read()


def _read_path(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(_JSON_LIMIT)


def _read_json(ref: str, read: Callable[[], bytes], what: str) -> dict[str, Any]:
    try:
        data = json.loads(read())
    except FileNotFoundError as e:
        raise SandboxImageError(f"image {ref}: {what} is missing") from e
    except (OSError, ValueError, tarfile.TarError) as e:
        raise SandboxImageError(f"image {ref}: cannot read {what} ({e})") from e
    if not isinstance(data, dict):
        raise SandboxImageError(f"image {ref}: {what} is not a JSON object")
    return data


def _pick_manifest(ref: str, index: dict[str, Any]) -> dict[str, Any]:
    """The one image manifest of an index; an index of several must tag one 'latest'."""
    manifests = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    if not manifests:
        raise SandboxImageError(f"image {ref}: its index lists no manifest")
    if len(manifests) > 1:
        names = {(m.get("annotations") or {}).get("org.opencontainers.image.ref.name"): m
                 for m in manifests}
        if "latest" not in names:
            raise SandboxImageError(f"image {ref}: its index lists {len(manifests)} images "
                                    f"({', '.join(map(str, names))}); keep one, or tag one "
                                    "'latest'")
        manifests = [names["latest"]]
    chosen = manifests[0]
    if chosen.get("mediaType") in INDEX_TYPES:
        raise SandboxImageError(f"image {ref}: a multi-platform index; export one platform "
                                "(e.g. `skopeo copy --override-arch`)")
    digest = chosen.get("digest")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise SandboxImageError(f"image {ref}: bad manifest digest {digest!r}")
    return chosen


def _write_index(into: str, descriptor: dict[str, Any]) -> None:
    entry = {"mediaType": descriptor.get("mediaType", MANIFEST_TYPES[0]),
             "digest": descriptor["digest"], "size": descriptor.get("size"),
             "annotations": {"org.opencontainers.image.ref.name": REF_NAME}}
    _write_file(os.path.join(into, "index.json"),
                json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode())
    _write_file(os.path.join(into, "oci-layout"), b'{"imageLayoutVersion": "1.0.0"}')


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _blob_path(layout: str, digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return os.path.join(layout, "blobs", algorithm, hexdigest)


def _chunks(stream: IO[bytes]) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


def _copy_blob(ref: str, tar: tarfile.TarFile, member: tarfile.TarInfo, into: str,
               digest: str | None) -> tuple[str, int]:
    """Copy one member into the layout as a blob; check it against `digest` if given.

    Returns the blob's digest and size.
    """
    algorithm = (digest or "sha256:").partition(":")[0]
    hasher = hashlib.new(algorithm)
    tmp = os.path.join(into, "blobs", ".incoming")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in _chunks(_extract(tar, member)):
                hasher.update(chunk)
                out.write(chunk)
                size += len(chunk)
    except (OSError, tarfile.TarError) as e:
        raise SandboxImageError(f"image {ref}: cannot read {member.name!r} ({e})") from e
    actual = f"{algorithm}:{hasher.hexdigest()}"
    if digest is not None and actual != digest:
        raise SandboxImageError(f"image {ref}: blob {member.name!r} is corrupt (its content "
                                f"hashes to {actual})")
    os.makedirs(os.path.dirname(_blob_path(into, actual)), exist_ok=True)
    os.replace(tmp, _blob_path(into, actual))
    return actual, size


def _docker_entry(ref: str, tar: tarfile.TarFile,
                  members: dict[str, tarfile.TarInfo]) -> dict[str, Any]:
    try:
        manifest = json.loads(_read_member(ref, tar, members, "manifest.json"))
    except ValueError as e:
        raise SandboxImageError(f"image {ref}: manifest.json is not JSON ({e})") from e
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
        raise SandboxImageError(f"image {ref}: a docker archive must hold exactly one image "
                                "(its manifest.json is a list of one object)")
    entry = manifest[0]
    if not isinstance(entry.get("Config"), str) or not isinstance(entry.get("Layers"), list):
        raise SandboxImageError(f"image {ref}: manifest.json lacks Config or Layers")
    return entry


def _convert_docker(ref: str, tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo],
                    into: str) -> None:
    """The older `docker save` format as an OCI layout: blobs, manifest, index."""
    entry = _docker_entry(ref, tar, members)
    config = _read_member(ref, tar, members, entry["Config"])
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    os.makedirs(os.path.join(into, "blobs", "sha256"), exist_ok=True)
    _write_file(_blob_path(into, config_digest), config)
    layers = []
    for name in entry["Layers"]:
        member = members.get(os.path.normpath(str(name)))
        if member is None:
            raise SandboxImageError(f"image {ref}: the archive lacks layer {name!r}")
        digest, size = _copy_blob(ref, tar, member, into, None)
        with open(_blob_path(into, digest), "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        layers.append({"mediaType": _LAYER_GZIP if gzipped else _LAYER_TAR,
                       "digest": digest, "size": size})
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0],
                           "config": {"mediaType": _CONFIG_TYPE, "digest": config_digest,
                                      "size": len(config)},
                           "layers": layers}, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    _write_file(_blob_path(into, manifest_digest), manifest)
    _write_index(into, {"mediaType": MANIFEST_TYPES[0], "digest": manifest_digest,
                        "size": len(manifest)})
