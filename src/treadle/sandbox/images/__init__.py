"""Environment images for sandboxes: a root file system for `/` instead of the host's dirs.

An image ref is a path: a root file system directory (used in place), an OCI image
layout directory, a tar archive (an OCI layout in a tar, or `docker save`'s
output), or a SIF file (Apptainer's). OCI, docker and SIF images are unpacked once
per host into an `ImageCache`
(by digest, shared read-only, evicted by size); `BwrapBackend(image=...)` runs
sandboxes on them. See docs/sandbox.md, "Images".
"""

from treadle.sandbox.images._layout import ImageConfig, Source, identify
from treadle.sandbox.images.cache import (
    CachedImage,
    ImageCache,
    default_cache,
    default_cache_root,
)

__all__ = ["CachedImage", "ImageCache", "ImageConfig", "Source", "default_cache",
           "default_cache_root", "identify"]
