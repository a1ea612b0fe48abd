"""Environment images on a sandbox server (`treadle sandbox-server --images DIR`):
a client names an image under the server's images root and its sandboxes run on it;
anything else is refused (real bwrap, the Debian image of sandbox_images.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_images
from sandbox_helpers import SMALL, require_bwrap, run

from treadle.errors import SandboxImageError
from treadle.sandbox import BwrapBackend, LocalBackend
from treadle.sandbox.cli import main
from treadle.sandbox.images import ImageCache
from treadle.sandbox.remote import RemoteBackend
from treadle.sandbox.served_images import ServedImages
from treadle.sandbox.server import RunningServer, serve_in_thread

pytestmark = pytest.mark.integration
TOKEN = "test-token-" + "i" * 20


@pytest.fixture
def image_server(work_root: str, debian_rootfs: Path,
                 image_cache: ImageCache) -> Iterator[RunningServer]:
    """A bwrap server whose images root holds the Debian tree."""
    require_bwrap()
    backend = BwrapBackend(work_root=work_root, image_cache=image_cache)
    with serve_in_thread(backend, TOKEN, images=str(debian_rootfs.parent)) as server:
        yield server


def _os_release(backend: RemoteBackend) -> str:
    async def body() -> str:
        async with await backend.start(SMALL) as sb:
            result = await sb.exec(["cat", "/etc/os-release"], timeout_s=10)
            assert result.exit_code == 0, result
            return result.stdout

    return run(body())


def test_a_remote_sandbox_runs_on_the_image_its_client_names(
        image_server: RunningServer, debian_rootfs: Path) -> None:
    remote = RemoteBackend([image_server.url], TOKEN)
    on_image = remote.with_image(str(debian_rootfs))
    assert _os_release(on_image) == (debian_rootfs / "etc" / "os-release").read_text()
    assert sandbox_images.image_suite() in _os_release(on_image)
    # The same servers without an image: the host's view, as before.
    assert _os_release(remote) == Path("/etc/os-release").read_text()
    assert remote.image is None and on_image.image == str(debian_rootfs)


@pytest.mark.parametrize("where", ["/", "/etc", "{root}/../.."])
def test_an_image_outside_the_servers_root_is_refused(
        image_server: RunningServer, debian_rootfs: Path, where: str) -> None:
    ref = where.format(root=debian_rootfs)
    with pytest.raises(SandboxImageError, match="not under this server's images root"):
        _os_release(RemoteBackend([image_server.url], TOKEN).with_image(ref))


def test_a_server_without_images_runs_none(work_root: str, debian_rootfs: Path) -> None:
    require_bwrap()
    with serve_in_thread(BwrapBackend(work_root=work_root), TOKEN) as server:
        backend = RemoteBackend([server.url], TOKEN).with_image(str(debian_rootfs))
        with pytest.raises(SandboxImageError, match="runs no images"):
            _os_release(backend)


def test_a_symlink_under_the_root_to_elsewhere_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "images"
    root.mkdir()
    (root / "escape").symlink_to("/")
    images = ServedImages(BwrapBackend(work_root=str(tmp_path)), str(root))
    with pytest.raises(SandboxImageError, match="not under"):
        images.backend_for(str(root / "escape"))


def test_a_backend_without_images_is_refused_and_the_last_images_are_kept(
        tmp_path: Path) -> None:
    with pytest.raises(SandboxImageError, match="cannot run images"):
        ServedImages(LocalBackend(work_root=str(tmp_path)), str(tmp_path)).backend_for(
            str(tmp_path))
    refs = [tmp_path / name for name in "abc"]
    for ref in refs:
        ref.mkdir()
    images = ServedImages(BwrapBackend(work_root=str(tmp_path)), str(tmp_path), kept=2)
    first = images.backend_for(str(refs[0]))
    assert images.backend_for(str(refs[0])) is first  # opened once, shared
    assert first.image == os.path.realpath(refs[0])
    images.backend_for(str(refs[1]))
    images.backend_for(str(refs[2]))  # the least recently used (a) goes
    assert images.backend_for(str(refs[0])) is not first
    assert images.backend_for(None) is images.backend


def test_cli_exec_on_a_remote_image(image_server: RunningServer, debian_rootfs: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sandbox", "exec", "--backend", "remote", "--server", image_server.url,
                 "--token", TOKEN, "--image", str(debian_rootfs), "--",
                 "cat", "/etc/os-release"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["stdout"] == (debian_rootfs / "etc" / "os-release").read_text()
    assert main(["sandbox", "exec", "--backend", "local", "--image", str(debian_rootfs),
                 "--", "true"]) == 2
    assert "--image needs --backend bwrap" in capsys.readouterr().err
