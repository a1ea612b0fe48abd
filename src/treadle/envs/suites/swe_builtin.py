"""The built-in `swe-images` instances: real PyPI projects with a real bug put back, each in
an image built here, without any image registry.

Each instance (``treadle/envs/data/swe_images/*.json``) names a pure-Python sdist
(name, version, sha256), a ``bug_patch`` that reverts an upstream fix (and removes
the fix's regression test), and the SWE-bench-style instance (issue text, gold
patch = the upstream fix, test_patch = its regression test). Building its image:

1. a Debian root file system, ``mmdebstrap --variant=essential
   --include=python3,python3-pytest`` (the release `DEBIAN_SUITE`, mirror
   ``$TREADLE_DEBIAN_MIRROR``), built once per host;
2. the sdist, fetched with ``pip download --no-binary :all: --no-deps`` (treadle's
   interpreter's pip, else ``pip3`` on PATH) and checked
   against its sha256, unpacked, ``bug_patch`` applied;
3. an OCI image layout: the root file system as one layer, the project in
   ``/testbed`` (the config's ``WorkingDir``) as a second.

Everything lands in ``<image cache's parent>/swe-images/`` (a lock makes parallel
builders build once) and is reused afterwards. Needs mmdebstrap, a Debian mirror and
PyPI on the first build (`SweImageBuildError` otherwise).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from treadle.envs.errors import EnvConfigError
from treadle.envs.tools.patch import apply_hunks, parse_unified_diff
from treadle.sandbox.images import default_cache_root

DEBIAN_SUITE = "trixie"
PACKAGES = "python3,python3-pytest"
WORKING_DIR = "/testbed"
_ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE=1"]
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MTIME = 1_700_000_000


class SweImageBuildError(EnvConfigError):
    """A built-in image could not be built (no mmdebstrap, no mirror, no PyPI, a bad sdist)."""


@functools.cache
def builtin_specs() -> dict[str, dict[str, Any]]:
    """instance_id -> the built-in spec (sdist, bug_patch, instance record)."""
    root = resources.files("treadle.envs").joinpath("data").joinpath("swe_images")
    specs = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            spec = json.loads(entry.read_text("utf-8"))
            specs[spec["instance"]["instance_id"]] = spec
    return specs


def builtin_dir() -> Path:
    return Path(default_cache_root()).parent / "swe-images"


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Held while one process builds what others wait for (an image under `path`'s
    folder); released when the block exits or the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SweImageBuildError(f"{what} failed (exit {proc.returncode}): "
                                 f"{(proc.stderr or proc.stdout)[-2000:]}")


def _traversable(*paths: Path) -> None:
    for path in paths:  # the sandbox uid must traverse to what it runs on
        os.chmod(path, os.stat(path).st_mode | 0o711)


def debian_rootfs(base: Path) -> Path:
    """The Debian root file system with python3 and pytest, built on first use."""
    target = base / f"debian-{DEBIAN_SUITE}-python3-pytest"
    if (target / "etc" / "os-release").exists():
        return target
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise SweImageBuildError("building the built-in images needs mmdebstrap "
                                 "(bash scripts/system-deps.sh mmdebstrap)")
    building = base / f".build-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    mirror = os.environ.get("TREADLE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    _run([mmdebstrap, "--quiet", "--variant=essential", f"--include={PACKAGES}", DEBIAN_SUITE,
          str(building), mirror], "mmdebstrap")
    _traversable(base.parent, base, building)
    building.rename(target)
    return target


def _sdist(sdist: dict[str, str], into: Path) -> Path:
    """The sdist unpacked under `into` (checked against its sha256); its top directory."""
    name, version = sdist["name"], sdist["version"]
    if importlib.util.find_spec("pip") is not None:
        pip = [sys.executable, "-m", "pip"]
    elif (found := shutil.which("pip3") or shutil.which("pip")) is not None:
        pip = [found]
    else:
        raise SweImageBuildError("building the built-in images needs pip (to download "
                                 f"the {name} sdist)")
    _run([*pip, "download", "--quiet", "--no-binary", ":all:", "--no-deps", "--dest",
          str(into), f"{name}=={version}"], f"pip download {name}")
    archives = list(into.glob("*.tar.gz"))
    if len(archives) != 1:
        raise SweImageBuildError(f"pip download {name}=={version} gave {archives}")
    digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
    if digest != sdist["sha256"]:
        raise SweImageBuildError(f"{archives[0].name}: sha256 {digest}, expected "
                                 f"{sdist['sha256']}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(into, filter="data")
    return into / f"{name}-{version}"


def _project_layer(project: Path, bug_patch: str) -> bytes:
    """The project under /testbed, with `bug_patch` applied, as a tar."""
    files = {str(p.relative_to(project)): p.read_bytes()
             for p in sorted(project.rglob("*")) if p.is_file()}
    for patch in parse_unified_diff(bug_patch):
        text, _ = apply_hunks(files[patch.path].decode(), patch.hunks, patch.path)
        files[patch.path] = text.encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = {WORKING_DIR.lstrip("/")}
        for path in files:
            parts = path.split("/")[:-1]
            dirs.update("/".join([WORKING_DIR.lstrip("/"), *parts[:i + 1]])
                        for i in range(len(parts)))
        for name in sorted(dirs):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, _MTIME
            tar.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo(f"{WORKING_DIR.lstrip('/')}/{path}")
            info.size, info.mode, info.mtime = len(data), 0o644, _MTIME
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _oci_layout(dest: Path, layers: list[bytes]) -> None:
    dest.mkdir(parents=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    diff_ids = ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in layers]
    descriptors = [{"mediaType": _LAYER, **_blob(dest, raw)} for raw in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": _ENV, "WorkingDir": WORKING_DIR},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": _MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **_blob(dest, config)},
        "layers": descriptors}).encode()
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": _MANIFEST, **_blob(dest, manifest)}]}))


def builtin_image(instance_id: str) -> Path:
    """The OCI layout of a built-in instance, built on first use (see the module docstring)."""
    spec = builtin_specs()[instance_id]
    key = hashlib.sha256(json.dumps([DEBIAN_SUITE, PACKAGES, spec["sdist"], spec["bug_patch"]],
                                    sort_keys=True).encode()).hexdigest()[:16]
    base = builtin_dir()
    target = base / f"{instance_id}-{key}.oci"
    with build_lock(base / ".lock"):
        if (target / "index.json").exists():
            return target
        rootfs = debian_rootfs(base)
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            project = _sdist(spec["sdist"], Path(tmp))
            base_layer = Path(tmp) / "rootfs.tar"
            with tarfile.open(base_layer, "w", format=tarfile.PAX_FORMAT) as tar:
                for entry in sorted(os.listdir(rootfs)):
                    tar.add(rootfs / entry, arcname=entry)
            building = Path(tmp) / "layout"
            _oci_layout(building, [base_layer.read_bytes(),
                                   _project_layer(project, spec["bug_patch"])])
            building.rename(target)
        _traversable(target)
        return target


def builtin_records() -> list[dict[str, Any]]:
    """The built-in instances' records, each with its image built (first use: minutes)."""
    return [{**spec["instance"], "image": str(builtin_image(instance_id))}
            for instance_id, spec in builtin_specs().items()]
