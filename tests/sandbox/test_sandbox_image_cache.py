"""The image cache on small images (no sandbox): formats, digests, eviction, hostile input.

Real umoci unpacks every image; the images are a few layers of a few files each
(sandbox_images.oci_layout without a base tree).
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import tarfile
from pathlib import Path

import pytest
import sandbox_images

from treadle.errors import SandboxImageError
from treadle.sandbox._image_root import seed_workdir
from treadle.sandbox._view import file_view
from treadle.sandbox.cli import main
from treadle.sandbox.images import CachedImage, ImageCache, ImageConfig, identify

pytestmark = pytest.mark.integration


def tiny(tmp_path: Path, name: str = "tiny", **kwargs: object) -> Path:
    return sandbox_images.oci_layout(None, tmp_path / name, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["oci-layout", "oci-archive", "docker-archive"])
def test_each_format_unpacks_its_layers_and_config(kind: str, tmp_path: Path) -> None:
    layout = tiny(tmp_path)
    ref = {"oci-layout": lambda: layout,
           "oci-archive": lambda: sandbox_images.oci_archive(layout, tmp_path / "a.tar"),
           "docker-archive": lambda: sandbox_images.docker_archive(layout, tmp_path / "d.tar"),
           }[kind]()
    image = ImageCache(str(tmp_path / "cache")).open(str(ref))
    root = Path(image.rootfs)
    assert image.kind == kind and image.unpacked_s is not None
    assert (root / "etc" / "treadle-layer").read_text() == "second layer\n"
    assert (root / "project" / "hello.py").exists()
    assert os.listdir(root / "usr" / "share" / "doc") == ["only-this"]
    assert not any(name.startswith(".wh.") for _, _, files in os.walk(root) for name in files)
    assert dict(image.config.env) == sandbox_images.ENV
    assert image.config.working_dir == "/project" and image.config.user == "nobody"


def test_digests_name_the_content_not_the_container(tmp_path: Path) -> None:
    layout = tiny(tmp_path)
    archive = sandbox_images.oci_archive(layout, tmp_path / "a.tar")
    assert identify(str(layout)).digest == identify(str(archive)).digest
    other = tiny(tmp_path, "other", extra=lambda tar: sandbox_images.add_bytes(tar, "x", b"1"))
    assert identify(str(other)).digest != identify(str(layout)).digest


def test_least_recently_used_images_not_in_use_are_evicted(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"), max_bytes=1)  # any second image is too many

    def image(name: str) -> Path:
        return tiny(tmp_path, name, extra=lambda tar: sandbox_images.add_bytes(tar, name, b"."))

    first = cache.open(str(image("first")))
    first_dir = os.path.dirname(first.rootfs)
    second = cache.open(str(image("second")))  # `first` is in use: both stay
    assert {os.path.dirname(second.rootfs), first_dir} == {e[0] for e in cache.entries()}
    first.release()
    del first
    gc.collect()
    third = cache.open(str(image("third")))  # evicts `first` (free), keeps `second` (held)
    assert {e[0] for e in cache.entries()} == {os.path.dirname(second.rootfs),
                                               os.path.dirname(third.rootfs)}
    assert not os.path.exists(first_dir)
    assert not [n for n in os.listdir(cache.root) if n.startswith(".staging")]


def test_a_corrupt_blob_is_refused(tmp_path: Path) -> None:
    layout = tiny(tmp_path)
    archive = sandbox_images.oci_archive(layout, tmp_path / "a.tar")
    blobs = layout / "blobs" / "sha256"
    largest = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    corrupt_archive = sandbox_images.oci_archive(layout, tmp_path / "corrupt.tar")
    cache = ImageCache(str(tmp_path / "cache"))
    for ref in (layout, corrupt_archive):
        with pytest.raises(SandboxImageError):
            cache.open(str(ref))
    assert cache.entries() == []
    assert cache.open(str(archive)).unpacked_s is not None  # the intact copy still works


def test_unsafe_archive_member_names_are_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        sandbox_images.add_bytes(tar, "oci-layout", b"{}")
        sandbox_images.add_bytes(tar, "../escaped", b"x")
    with pytest.raises(SandboxImageError, match="unsafe member"):
        ImageCache(str(tmp_path / "cache")).open(str(archive))
    assert not (tmp_path.parent / "escaped").exists()


def test_a_hostile_layer_cannot_write_outside_its_root_or_make_devices(tmp_path: Path) -> None:
    target = tmp_path / f"target-{secrets.token_hex(4)}"
    target.mkdir()
    tag = secrets.token_hex(4)

    def hostile(tar: tarfile.TarFile) -> None:
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, str(target)
        tar.addfile(link)
        sandbox_images.add_bytes(tar, "link/pwned", b"through a link")
        sandbox_images.add_bytes(tar, f"../../escape-{tag}", b"dot-dot")
        sandbox_images.add_bytes(tar, f"/abs-{tag}", b"absolute")
        device = tarfile.TarInfo("dev/evil")
        device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3
        tar.addfile(device)

    layout = tiny(tmp_path, extra=hostile)
    cache = ImageCache(str(tmp_path / "cache"))
    try:
        root = Path(cache.open(str(layout)).rootfs)
    except SandboxImageError:
        root = None  # refusing the image is as good as containing it
    assert os.listdir(target) == []
    for base in (tmp_path, tmp_path.parent, Path("/"), Path(cache.root)):
        assert not list(base.glob(f"escape-{tag}")) and not list(base.glob(f"abs-{tag}"))
    if root is not None:
        evil = root / "dev" / "evil"
        assert not evil.exists() or evil.is_file() or evil.is_symlink()
        assert not (evil.exists() and evil.stat().st_rdev)


def test_a_rootfs_directory_is_used_in_place(tmp_path: Path) -> None:
    (tmp_path / "rootfs" / "usr").mkdir(parents=True)
    image = ImageCache(str(tmp_path / "cache")).open(str(tmp_path / "rootfs"))
    assert image.kind == "rootfs" and image.rootfs == str(tmp_path / "rootfs")
    assert image.digest is None and not (tmp_path / "cache").exists()


def test_a_working_dir_behind_a_link_is_never_followed_on_the_host(tmp_path: Path) -> None:
    secret_dir = tmp_path / "host-secret"
    (secret_dir / "b").mkdir(parents=True)
    (secret_dir / "b" / "key").write_text("secret")
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    (rootfs / "a").symlink_to(secret_dir)
    (rootfs / "proj").symlink_to(secret_dir / "b")
    image = CachedImage(ref="test", kind="rootfs", digest=None, rootfs=str(rootfs),
                        config=ImageConfig())
    view = file_view("/work", (), ())
    with pytest.raises(ValueError, match="link"):
        view.for_image(str(rootfs), "/a/b")
    assert view.for_image(str(rootfs), "/proj").mount_point == "/proj"  # top-level: a new dir
    work = tmp_path / "work"
    for working_dir in ("/a/b", "/proj"):
        work.mkdir()
        seed_workdir(image, working_dir, str(work), None)
        assert os.listdir(work) == []
        work.rmdir()


def test_the_unpack_command_prewarms_the_cache(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    layout = tiny(tmp_path)
    argv = ["sandbox", "unpack", str(layout), "--image-cache", str(tmp_path / "cache")]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["kind"] == "oci-layout" and first["unpacked_s"] is not None
    assert first["working_dir"] == "/project" and first["env"] == sandbox_images.ENV
    assert (Path(first["rootfs"]) / "project" / "hello.py").exists()
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["unpacked_s"] is None and again["digest"] == first["digest"]
    assert main(["sandbox", "unpack", str(tmp_path / "absent"), "--image-cache",
                 str(tmp_path / "cache")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_evict_on_demand_keeps_what_is_in_use(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path / "cache"))
    held = cache.open(str(tiny(tmp_path, "held")))
    free = cache.open(str(tiny(tmp_path, "free", gzip_top=False)))
    free.release()
    cache.max_bytes = 1
    assert cache.evict() == 1
    assert [e[0] for e in cache.entries()] == [os.path.dirname(held.rootfs)]
