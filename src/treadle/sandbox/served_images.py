"""The environment images a sandbox server runs (`treadle sandbox-server --images DIR`).

A client names an image by its ref as the server's host sees it (a root file system
dir, an OCI layout dir, an OCI/docker-save tar, or a SIF file;
`treadle.sandbox.images`). The server runs only images under its images root: a
ref is resolved (symbolic links and `..` included) and refused unless it lies
there, so a client cannot mount an arbitrary host tree as a sandbox's `/`. A
server started without `--images` runs none. Each accepted image gets a backend of
the server's kind on it (`SandboxBackend.with_image`), opened on its first sandbox
and shared by the next; the `kept` most recently used are kept (an image stays
unpacked in the host's cache either way; a backend dropped here releases its hold
once its sandboxes close).

Refusals are SandboxImageError (permanent: a client does not retry them elsewhere
as if the server were busy).
"""

from __future__ import annotations

import os
from collections import OrderedDict

from treadle.errors import SandboxImageError, SandboxUnsupported
from treadle.sandbox.base import SandboxBackend

DEFAULT_KEPT = 8


class ServedImages:
    """Images under `root` on `backend`'s kind (module docstring)."""

    def __init__(self, backend: SandboxBackend, root: str | None, *,
                 kept: int = DEFAULT_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"kept must be >= 1, got {kept}")
        self.backend = backend
        self.root = None if root is None else os.path.realpath(root)
        self.kept = kept
        self._backends: OrderedDict[str, SandboxBackend] = OrderedDict()

    def backend_for(self, image: str | None) -> SandboxBackend:
        """The backend a sandbox on `image` starts from (None: the server's own)."""
        if image is None:
            return self.backend
        if self.root is None:
            raise SandboxImageError("this sandbox server runs no images (start it with "
                                    "--images DIR to serve the images under DIR)")
        path = os.path.realpath(image)
        if os.path.commonpath([self.root, path]) != self.root:
            raise SandboxImageError(f"image {image!r} is not under this server's images "
                                    f"root {self.root}")
        if path in self._backends:
            self._backends.move_to_end(path)
            return self._backends[path]
        try:
            backend = self.backend.with_image(path)
        except SandboxUnsupported as e:
            raise SandboxImageError(f"this sandbox server's backend cannot run images: {e}") \
                from None
        self._backends[path] = backend
        while len(self._backends) > self.kept:
            self._backends.popitem(last=False)
        return backend


__all__ = ["DEFAULT_KEPT", "ServedImages"]
