"""Sandboxes on environment images, against real bwrap, mmdebstrap, umoci and
squashfs-tools.

The image is a Debian root file system of another release than the host's
(sandbox_images.py), used as a directory and as OCI layout, OCI archive and
docker-save archive (each unpacked once per session by the real umoci), and as a
SIF file (its squashfs read by the real unsquashfs).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_images
from sandbox_helpers import SMALL, require_bwrap, run
from test_sandbox_bench import check_backend_report

from treadle.bench.sandbox import run_sandbox_bench
from treadle.errors import SandboxImageError
from treadle.sandbox import BwrapBackend, ExecResult
from treadle.sandbox.cli import main
from treadle.sandbox.images import ImageCache, identify

pytestmark = pytest.mark.integration


def sh(backend: BwrapBackend, script: str) -> ExecResult:
    async def body() -> ExecResult:
        async with await backend.start(SMALL) as sb:
            return await sb.exec(["sh", "-c", script], timeout_s=10)

    return run(body())


@pytest.fixture(scope="session")
def oci_dir(debian_rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Debian tree as an OCI layout: its tree as a layer, then the top layer
    (removed at the end: pytest keeps its last temporary dirs, and this is ~150 MB)."""
    where = tmp_path_factory.mktemp("oci")
    yield sandbox_images.oci_layout(debian_rootfs, where / "layout")
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session", params=["oci-layout", "oci-archive", "docker-archive"])
def image_ref(request: pytest.FixtureRequest, oci_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "oci-layout":
        yield str(oci_dir)
        return
    where = tmp_path_factory.mktemp("archive")
    write = sandbox_images.oci_archive if request.param == "oci-archive" \
        else sandbox_images.docker_archive
    yield str(write(oci_dir, where / "image.tar"))
    shutil.rmtree(where, ignore_errors=True)


def test_cli_shows_the_images_os_release_not_the_hosts(
        debian_rootfs: Path, image_cache: ImageCache, capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    code = main(["sandbox", "exec", "--backend", "bwrap", "--image", str(debian_rootfs),
                 "--image-cache", image_cache.root, "--", "cat", "/etc/os-release"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["exit_code"] == 0, payload
    assert payload["stdout"] == (debian_rootfs / "etc" / "os-release").read_text()
    assert payload["stdout"] != Path("/etc/os-release").read_text()
    assert sandbox_images.image_suite() in payload["stdout"]


def test_the_image_is_read_only_and_work_dir_writes_vanish_with_the_sandbox(
        image_bwrap: BwrapBackend, debian_rootfs: Path) -> None:
    result = sh(image_bwrap, "touch /etc/treadle-probe /usr/bin/treadle-probe; "
                             "echo kept > /work/note && cat /work/note && echo t > /tmp/t "
                             "&& pwd && echo $HOME")
    assert result.stdout == "kept\n/work\n/work\n", result
    assert result.stderr.count("Read-only file system") == 2, result
    assert not (debian_rootfs / "etc" / "treadle-probe").exists()
    after = sh(image_bwrap, "ls -A /work /tmp")
    assert after.stdout.split() == ["/tmp:", "/work:"], after


def test_two_sandboxes_of_one_image_do_not_see_each_others_writes(
        image_bwrap: BwrapBackend) -> None:
    async def body() -> tuple[ExecResult, ExecResult]:
        async with await image_bwrap.start(SMALL) as a, await image_bwrap.start(SMALL) as b:
            wrote = await a.exec(["sh", "-c", "echo a > /work/mine && echo a > /tmp/mine"],
                                 timeout_s=10)
            assert wrote.ok, wrote
            seen = await b.exec(["sh", "-c", "ls -A /work /tmp"], timeout_s=10)
            own = await a.exec(["cat", "/work/mine"], timeout_s=10)
            return seen, own

    seen, own = run(body())
    assert seen.stdout.split() == ["/tmp:", "/work:"], seen
    assert own.stdout == "a\n"


def test_the_resident_executor_runs_the_images_python(image_bwrap: BwrapBackend,
                                                      debian_rootfs: Path) -> None:
    async def body() -> tuple[bool, ExecResult]:
        async with await image_bwrap.start(SMALL) as sb:
            result = await sb.exec(["python3", "-c", "import sys; print(sys.version_info[:2])"],
                                   timeout_s=10)
            return sb.keeps_python_session, result  # type: ignore[attr-defined]

    session, result = run(body())
    version = os.readlink(debian_rootfs / "usr" / "bin" / "python3").removeprefix("python")
    assert session and result.ok, result
    assert result.stdout.strip() == str(tuple(map(int, version.split("."))))


def test_oci_and_docker_images_run_with_their_layers_env_and_working_dir(
        image_ref: str, work_root: str, image_cache: ImageCache, debian_rootfs: Path) -> None:
    require_bwrap()
    backend = BwrapBackend(work_root=work_root, image=image_ref, image_cache=image_cache)
    script = ("cat /etc/os-release; echo; ls /etc/debian_version; ls /usr/share/doc; "
              "echo $TREADLE_IMAGE_VAR $HOME; pwd; python3 hello.py; echo mine > new.txt; "
              "ls")

    async def body() -> tuple[ExecResult, ExecResult]:
        async with await backend.start(SMALL) as sb:
            first = await sb.exec(["sh", "-c", script], timeout_s=20)
            await sb.put_file("/project/put.txt", b"from the host")
            assert await sb.get_file("new.txt") == b"mine\n"
            assert (await sb.exec(["cat", "put.txt"], timeout_s=20)).stdout == "from the host"
        async with await backend.start(SMALL) as sb:
            again = await sb.exec(["ls"], timeout_s=20)
        return first, again

    first, again = run(body())
    os_release, _, rest = first.stdout.partition("\n\n")
    assert os_release + "\n" == (debian_rootfs / "etc" / "os-release").read_text()
    assert rest.splitlines() == [
        "only-this",  # the opaque directory replaced the base layer's docs
        "from-the-image /project", "/project", "hello from the image", "hello.py", "new.txt"]
    assert "debian_version" in first.stderr  # removed by the top layer's whiteout
    assert again.stdout == "hello.py\n", again  # the copy of /project was private
    assert backend.mount_point == sandbox_images.WORKING_DIR


@pytest.fixture(scope="session")
def sif_file(debian_rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("sif")
    yield sandbox_images.sif_image(debian_rootfs, where / "debian.sif")
    shutil.rmtree(where, ignore_errors=True)


def test_a_sif_image_runs_on_its_squashfs_partition_unpacked_once(
        sif_file: Path, debian_rootfs: Path, image_cache: ImageCache,
        capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    code = main(["sandbox", "exec", "--backend", "bwrap", "--image", str(sif_file),
                 "--image-cache", image_cache.root, "--", "sh", "-c",
                 "cat /etc/os-release; python3 -c 'print(6 * 7)'; touch /etc/probe"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0, payload
    os_release = (debian_rootfs / "etc" / "os-release").read_text()
    assert payload["stdout"] == os_release + "42\n"
    assert "Read-only file system" in payload["stderr"]
    again = image_cache.open(str(sif_file))
    assert again.kind == "sif" and again.unpacked_s is None  # the exec unpacked it
    assert again.digest is not None and again.digest.replace(":", "-") in again.rootfs


def test_a_sif_without_one_plain_squashfs_system_partition_is_refused(
        sif_file: Path, tmp_path: Path, work_root: str, image_cache: ImageCache) -> None:
    require_bwrap()
    empty = tmp_path / "empty"
    (empty / "bin").mkdir(parents=True)
    truncated = tmp_path / "truncated.sif"
    truncated.write_bytes(sif_file.read_bytes()[:40_000])
    (empty / "notes.txt").write_text("".join(f"line {i} of a long note\n" for i in range(99_999)))
    damaged = tmp_path / "damaged.sif"  # a compressed block of notes.txt overwritten
    data = bytearray(sandbox_images.sif_image(empty, tmp_path / "ok.sif").read_bytes())
    middle = 32768 + (len(data) - 32768) // 3
    data[middle:middle + 64] = bytes(64)
    damaged.write_bytes(bytes(data))
    cases = [(damaged, "unsquashfs cannot read its system partition.*uncompress"),
             (sandbox_images.sif_image(empty, tmp_path / "enc.sif", fs_type=5),
              "an encrypted squashfs"),
             (sandbox_images.sif_image(empty, tmp_path / "data.sif", part_type=3),
              "0 system partitions"),
             (truncated, "lies outside the file")]
    for ref, words in cases:
        backend = BwrapBackend(work_root=work_root, image=str(ref), image_cache=image_cache)
        with pytest.raises(SandboxImageError, match=words):
            run(backend.start(SMALL))


def test_a_sif_is_keyed_by_its_partitions_bytes(sif_file: Path, tmp_path: Path,
                                                image_cache: ImageCache) -> None:
    copy = tmp_path / "copy.sif"
    shutil.copyfile(sif_file, copy)
    altered = tmp_path / "altered.sif"  # same header, table and sizes; other bytes
    data = bytearray(sif_file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 100] = bytes(b ^ 0xFF for b in data[middle:middle + 100])
    altered.write_bytes(bytes(data))
    first, again = image_cache.open(str(sif_file)), image_cache.open(str(copy))
    assert again.digest == first.digest and again.rootfs == first.rootfs
    assert identify(str(altered)).digest not in (None, first.digest)


def test_a_sif_leaves_no_device_foreign_owner_or_setuid_bit_in_the_cache(
        tmp_path: Path, image_cache: ImageCache) -> None:
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    sif = sandbox_images.sif_image(tree, tmp_path / "hostile.sif", pseudo=(
        "dev-mem c 666 0 0 1 1", "pipe i 666 0 0 f", "bin/suid f 6755 0 0 echo hi",
        "theirs f 644 4321 4321 echo theirs"))
    image = image_cache.open(str(sif))
    root = Path(image.rootfs)
    for name in ("dev-mem", "pipe"):  # an empty file in the device's place
        if name == "dev-mem" and os.getuid() != 0:
            assert not (root / name).exists()  # unsquashfs could not make it
            continue
        st = os.lstat(root / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0, name
    suid = os.lstat(root / "bin" / "suid")
    assert stat.S_IMODE(suid.st_mode) == 0o755 and (root / "bin" / "suid").read_text() == "hi\n"
    for path in (root / "theirs", root / "bin", root / "pipe"):
        assert (os.lstat(path).st_uid, os.lstat(path).st_gid) == (os.getuid(), os.getgid())


def test_a_cached_image_is_not_unpacked_again(oci_dir: Path, image_cache: ImageCache) -> None:
    first = image_cache.open(str(oci_dir))
    second = image_cache.open(str(oci_dir))
    assert second.unpacked_s is None and second.rootfs == first.rootfs
    assert first.digest is not None and first.digest.replace(":", "-") in first.rootfs


def test_a_missing_or_foreign_image_is_a_clear_error(
        tmp_path: Path, work_root: str, image_cache: ImageCache,
        capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "bare" / "usr").mkdir(parents=True)
    tiny = sandbox_images.oci_layout(None, tmp_path / "tiny")  # no shell, no prlimit
    for ref, words in [(tmp_path / "absent", "no such file"),
                       (tmp_path / "notes.txt", "not a readable tar"),
                       (tmp_path, "neither an OCI image layout"),
                       (tmp_path / "bare", "cannot reach its root file system|no /bin/sh"),
                       (tiny, "no /bin/sh")]:
        backend = BwrapBackend(work_root=work_root, image=str(ref), image_cache=image_cache)
        with pytest.raises(SandboxImageError, match=words):
            run(backend.start(SMALL))
    assert main(["sandbox", "exec", "--image", str(tmp_path / "absent"), "--image-cache",
                 image_cache.root, "--", "true"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_concurrent_opens_share_one_unpack(tmp_path: Path) -> None:
    tiny = sandbox_images.oci_layout(None, tmp_path / "tiny")
    cache = ImageCache(str(tmp_path / "cache"))

    async def body() -> list[float | None]:
        images = await asyncio.gather(*(asyncio.to_thread(cache.open, str(tiny))
                                        for _ in range(3)))
        return [image.unpacked_s for image in images]

    unpacked = run(body())
    assert sum(s is not None for s in unpacked) == 1, unpacked
    assert len(cache.entries()) == 1


def test_bench_measures_an_image_beside_the_host_view(debian_rootfs: Path) -> None:
    require_bwrap()
    report = run_sandbox_bench(["bwrap"], samples=2, concurrency=3, duration_s=0.3,
                               log=lambda _: None, image=str(debian_rootfs))
    assert list(report["backends"]) == ["bwrap", "bwrap-image"]
    entry = report["backends"]["bwrap-image"]
    for name in ("bwrap", "bwrap-image"):
        check_backend_report(report["backends"][name], samples=2, concurrency=3)
    assert entry["image"]["ok"] and entry["image"]["kind"] == "rootfs"
    assert entry["image"]["unpack_s"] is None and entry["image"]["cold_start_s"] > 0
    assert report["config"]["image"] == str(debian_rootfs)


def test_an_image_python_that_cannot_run_the_agent_falls_back_to_per_call_execs(
        debian_rootfs: Path, work_root: str, image_cache: ImageCache) -> None:
    require_bwrap()
    root = Path(tempfile.mkdtemp(prefix="treadle-test-oldpy-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        rootfs = root / "rootfs"
        copy = subprocess.run(["cp", "-al", str(debian_rootfs), str(rootfs)], check=False)
        if copy.returncode != 0:  # another file system: a real copy
            shutil.rmtree(rootfs, ignore_errors=True)
            shutil.copytree(debian_rootfs, rootfs, symlinks=True)
        python = rootfs / "usr" / "bin" / "python3"
        python.unlink()
        python.write_text("#!/bin/sh\necho too old >&2\nexit 3\n")
        python.chmod(0o755)
        backend = BwrapBackend(work_root=work_root, image=str(rootfs), image_cache=image_cache)

        async def body() -> tuple[ExecResult, bool]:
            async with await backend.start(SMALL) as sb:
                result = await sb.exec(["sh", "-c", "echo served"], timeout_s=10)
                return result, sb.keeps_python_session  # type: ignore[attr-defined]

        result, session = run(body())
        assert result.ok and result.stdout == "served\n" and not session, result
    finally:
        shutil.rmtree(root, ignore_errors=True)
