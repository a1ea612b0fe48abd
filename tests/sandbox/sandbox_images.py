"""Test images: a Debian root file system built once (mmdebstrap), and OCI/docker images of it.

The root file system is `mmdebstrap --variant=essential --include=python3` of a
Debian release other than the host's (so that its /etc/os-release differs from the
host's), built on first use (about a minute) into
`<image cache's parent>/test-images/` and reused by later runs; a lock makes
parallel test workers build it once. OCI layouts and archives are written here in
Python from that tree, plus a small second layer (a whiteout, an opaque directory,
a project dir), so the tests exercise real layer application by umoci; a SIF file
holds the tree as a squashfs made by the real mksquashfs.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from treadle.envs.suites.swe_builtin import build_lock
from treadle.sandbox.images import default_cache_root

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "TREADLE_IMAGE_VAR": "from-the-image"}
WORKING_DIR = "/project"
DEBIAN_MIRROR = os.environ.get("TREADLE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _host_codename() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip('"')
    return ""


def image_suite() -> str:
    """A Debian release whose os-release is not the host's."""
    return "bookworm" if _host_codename() == "trixie" else "trixie"


def test_images_dir() -> Path:
    return Path(default_cache_root()).parent / "test-images"


def debian_rootfs() -> tuple[Path, float | None]:
    """The cached Debian root file system, and the seconds building it took (None: cached)."""
    base = test_images_dir()
    suite = image_suite()
    target = base / f"debian-{suite}-essential-python3"
    with build_lock(base / ".lock"):
        if (target / "etc" / "os-release").exists():
            return target, None
        mmdebstrap = shutil.which("mmdebstrap")
        assert mmdebstrap, "mmdebstrap is not installed: bash scripts/system-deps.sh mmdebstrap"
        building = base / f".build-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        started = time.monotonic()
        # The mirror named: without one mmdebstrap reads a sources list from a stdin
        # that is not a terminal.
        proc = subprocess.run([mmdebstrap, "--quiet", "--variant=essential", "--include=python3",
                               suite, str(building), DEBIAN_MIRROR], capture_output=True,
                              text=True, check=False, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"mmdebstrap failed: {proc.stderr[-2000:]}"
        elapsed = time.monotonic() - started
        for path in (base.parent, base, building):  # the sandbox uid must traverse to it
            os.chmod(path, os.stat(path).st_mode | 0o711)
        building.rename(target)
        return target, elapsed


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
    tar.addfile(info)


def _top_layer(tar: tarfile.TarFile) -> None:
    """Deletes /etc/debian_version (a whiteout), replaces /usr/share/doc (opaque),
    adds /etc/treadle-layer and the working dir with a file in it."""
    add_bytes(tar, "etc/.wh.debian_version", b"")
    _add_dir(tar, "usr/share/doc")
    add_bytes(tar, "usr/share/doc/.wh..wh..opq", b"")
    add_bytes(tar, "usr/share/doc/only-this", b"opaque\n")
    add_bytes(tar, "etc/treadle-layer", b"second layer\n")
    _add_dir(tar, WORKING_DIR.lstrip("/"))
    add_bytes(tar, WORKING_DIR.lstrip("/") + "/hello.py", b"print('hello from the image')\n")


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"sha256:{digest}", len(data)


def _base_layer(rootfs: Path, out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(rootfs / entry, arcname=entry)


def _config(diff_ids: list[str], user: str) -> bytes:
    return json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [f"{k}={v}" for k, v in ENV.items()], "WorkingDir": WORKING_DIR,
                   "User": user},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }, sort_keys=True).encode()


def oci_layout(rootfs: Path | None, dest: Path, *, gzip_top: bool = True,
               extra: Callable[[tarfile.TarFile], None] | None = None,
               user: str = "nobody") -> Path:
    """An OCI image layout at `dest`: `rootfs` as one layer (if given), then the top
    layer (gzipped if `gzip_top`), then a layer `extra` writes, if given; its config's
    User is `user`."""
    dest.mkdir(parents=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    layers, diff_ids = [], []
    tars: list[tuple[bytes, bool]] = []
    if rootfs is not None:
        base = dest / "base.tar"
        _base_layer(rootfs, base)
        tars.append((base.read_bytes(), False))
        base.unlink()
    top = io.BytesIO()
    with tarfile.open(fileobj=top, mode="w") as tar:
        _top_layer(tar)
    tars.append((top.getvalue(), gzip_top))
    if extra:
        last = io.BytesIO()
        with tarfile.open(fileobj=last, mode="w") as tar:
            extra(tar)
        tars.append((last.getvalue(), False))
    for raw, zipped in tars:
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        digest, size = _blob(dest, gzip.compress(raw, mtime=0) if zipped else raw)
        layers.append({"mediaType": _LAYER + ("+gzip" if zipped else ""), "digest": digest,
                       "size": size})
    config_digest, config_size = _blob(dest, _config(diff_ids, user))
    manifest = json.dumps({"schemaVersion": 2, "mediaType": _MANIFEST,
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": config_digest, "size": config_size},
                           "layers": layers}).encode()
    digest, size = _blob(dest, manifest)
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": _MANIFEST, "digest": digest, "size": size}]}))
    return dest


def oci_archive(layout: Path, out: Path) -> Path:
    """The layout as a tar (what `skopeo copy oci-archive:` and Docker 25's save write)."""
    with tarfile.open(out, "w") as tar:
        for entry in ("oci-layout", "index.json", "blobs"):
            tar.add(layout / entry, arcname=entry)
    return out


def docker_archive(layout: Path, out: Path) -> Path:
    """The layout in the older `docker save` format: manifest.json, <id>.json, <n>/layer.tar."""
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].split(":")[1]).read_bytes())
    config_hex = manifest["config"]["digest"].split(":")[1]
    with tarfile.open(out, "w") as tar:
        tar.add(blobs / config_hex, arcname=f"{config_hex}.json")
        names = []
        for n, layer in enumerate(manifest["layers"]):
            data = (blobs / layer["digest"].split(":")[1]).read_bytes()
            if layer["mediaType"].endswith("+gzip"):
                data = gzip.decompress(data)
            add_bytes(tar, f"layer{n}/layer.tar", data)
            names.append(f"layer{n}/layer.tar")
        add_bytes(tar, "manifest.json", json.dumps([{
            "Config": f"{config_hex}.json", "RepoTags": ["treadle/test:latest"],
            "Layers": names}]).encode())
    return out


def sif_image(rootfs: Path, out: Path, *, fs_type: int = 1, part_type: int = 2,
              pseudo: tuple[str, ...] = ()) -> Path:
    """`rootfs` as a SIF file, laid out as the format's Go library writes one (no SIF
    tool runs on this machine): the header, 48 descriptors of which the first is a
    squashfs partition (`fs_type` 1, `part_type` 2: the primary system partition)
    made by the real `mksquashfs` (plus its `pseudo` file definitions: devices,
    owners and modes no unprivileged user could make), the partition at 32 KiB."""
    mksquashfs = shutil.which("mksquashfs")
    assert mksquashfs, "mksquashfs is not installed: bash scripts/system-deps.sh squashfs-tools"
    squash = out.with_suffix(".squashfs")
    proc = subprocess.run([mksquashfs, str(rootfs), str(squash), "-noappend", "-no-xattrs",
                           "-quiet", "-no-progress", "-comp", "gzip", "-Xcompression-level", "1",
                           *(arg for p in pseudo for arg in ("-p", p))],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    data = squash.read_bytes()
    squash.unlink()
    total, table_at, data_at = 48, 4096, 32768
    now = 1_700_000_000
    extra = struct.pack("<ii3s", fs_type, part_type, b"02\0").ljust(384, b"\0")
    descriptor = struct.pack("<i?3I7q128s384s", 0x4004, True, 1, 0xF0000001, 0, data_at,
                             len(data), len(data), now, now, 0, 0, b"rootfs", extra)
    unused = struct.pack("<i?3I7q128s384s", 0, False, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b"", b"")
    header = struct.pack("<32s10s3s3s16s8q", b"#!/usr/bin/env run-singularity\n",
                         b"SIF_MAGIC", b"01", b"02", b"treadle-test-sif", now, now, total - 1,
                         total, table_at, 585, data_at, len(data))
    table = descriptor + unused * (total - 1)
    with open(out, "wb") as f:
        f.write(header.ljust(table_at, b"\0") + table.ljust(data_at - table_at, b"\0") + data)
    return out
