"""An image's `User` inside its sandboxes (`_image_root.image_ids`): the ids commands
see in the sandbox's user namespace; on the host they stay the sandbox uid."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_images
from sandbox_helpers import SMALL, require_bwrap, run

from treadle.errors import SandboxImageError
from treadle.sandbox import BwrapBackend, ExecResult
from treadle.sandbox._image_root import image_ids
from treadle.sandbox.bwrap import NOBODY
from treadle.sandbox.images import CachedImage, ImageCache
from treadle.sandbox.images._layout import ImageConfig

PASSWD = "root:x:0:0::/root:/bin/sh\ndaemon:x:1:1::/:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n"
GROUP = "root:x:0:\ndaemon:x:1:\nstaff:x:50:\napp:x:1001:\n"


def _image(tmp_path: Path, user: str | None) -> CachedImage:
    etc = tmp_path / "rootfs" / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    return CachedImage(ref="test", kind="rootfs", digest=None, rootfs=str(etc.parent),
                       config=ImageConfig(user=user))


@pytest.mark.parametrize(("user", "ids"), [
    (None, None), ("app", (1000, 1001)), ("app:staff", (1000, 50)), ("1000", (1000, 1001)),
    ("4242", (4242, 0)), ("4242:7", (4242, 7)), ("daemon:1001", (1, 1001)),
    ("root", None), ("0:50", None),  # root is not applied
])
def test_a_user_resolves_through_the_images_own_tables(tmp_path: Path, user: str | None,
                                                       ids: tuple[int, int] | None) -> None:
    assert image_ids(_image(tmp_path, user)) == ids


@pytest.mark.parametrize("user", ["nobody-here", "app:nogroup", "99999999999"])
def test_an_unknown_or_malformed_user_is_refused(tmp_path: Path, user: str) -> None:
    with pytest.raises(SandboxImageError, match="User"):
        image_ids(_image(tmp_path, user))


def test_a_passwd_that_leads_out_of_the_image_is_not_read(tmp_path: Path) -> None:
    image = _image(tmp_path, "app")
    os.unlink(Path(image.rootfs) / "etc" / "passwd")
    os.symlink("/etc/passwd", Path(image.rootfs) / "etc" / "passwd")
    with pytest.raises(SandboxImageError, match="leads out of the image"):
        image_ids(image)


@pytest.fixture(scope="module")
def daemon_image(debian_rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Debian image with `User: daemon:staff` (ids 1 and 50 in Debian's tables)."""
    where = tmp_path_factory.mktemp("user-image")
    yield sandbox_images.oci_layout(debian_rootfs, where / "layout", user="daemon:staff")
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.integration
def test_commands_run_as_the_images_user_inside_and_the_sandbox_uid_outside(
        daemon_image: Path, work_root: str, image_cache: ImageCache) -> None:
    require_bwrap()
    backend = BwrapBackend(work_root=work_root, image=str(daemon_image), image_cache=image_cache)

    async def body() -> tuple[ExecResult, int]:
        async with await backend.start(SMALL) as sb:
            inside = await sb.exec(["sh", "-c", "id -u; id -g; touch made; stat -c %u:%g made"],
                                   timeout_s=20)
            outside = os.stat(os.path.join(sb.host_dir, "made")).st_uid
            return inside, outside

    inside, outside = run(body())
    assert inside.stdout.split() == ["1", "50", "1:50"], inside
    # On the host the file is the sandbox uid's, whatever the image's User says.
    assert outside == (NOBODY[0] if os.geteuid() == 0 else os.geteuid())
