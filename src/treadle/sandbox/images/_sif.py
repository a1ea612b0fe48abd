"""SIF images (Apptainer's and SingularityCE's format): where a file's root file
system is, read from its header and descriptors.

A SIF file is a global header (128 bytes: a launch line, ``SIF_MAGIC``, the spec
version, the architecture, the image's id, times, and where the descriptors and
the data are), a table of fixed-size descriptors (585 bytes each: the object's
type, whether it is used, ids, its offset and size, times, a name, and 384 bytes
of type-specific data), then the objects. The root file system is a partition
object (type 0x4004) holding a squashfs file system; its extra data says the file
system type (1: squashfs), the partition type (2: the primary system partition, 1:
a system partition) and the architecture. Little-endian throughout, no padding
(Go's `encoding/binary` of the structs in github.com/sylabs/sif/v2/pkg/sif).

`read_sif` finds the partition treadle unpacks: the primary system partition, else
the only system partition; an encrypted one (file system type 5), an ext3 one, or
an image with none is refused. The partition is unpacked by `unsquashfs` (Debian's
`squashfs-tools`) at its offset: no mount, no privilege (cache.py). Signatures are
not verified (treadle runs no SIF signing key): an image is trusted as the
operator's, like an OCI archive.

The cache keys an image by the sha256 of its system partition's bytes (what is
extracted): two files holding the same partition are one entry. Hashing reads the
partition once per process and file version (the cache remembers a file's
identification by its inode, size and modification time): about 0.7 s a GB here
(37 ms for the tests' 57 MB image).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

from treadle.errors import SandboxImageError

MAGIC = b"SIF_MAGIC"
_HEADER = struct.Struct("<32s10s3s3s16s8q")  # launch, magic, version, arch, id, 8 int64s
_DESCRIPTOR = struct.Struct("<i?3I7q128s384s")  # type, used, ids, offset..gid, name, extra
_PARTITION = struct.Struct("<ii3s")  # file system type, partition type, architecture
DATA_PARTITION = 0x4004
FS_SQUASHFS, FS_EXT3, FS_ENCRYPTED_SQUASHFS = 1, 2, 5
PART_SYSTEM, PART_PRIMARY_SYSTEM = 1, 2
MAX_DESCRIPTORS = 4096  # far above the 48 SIF tools allot: a bound against a damaged file


@dataclass(frozen=True, slots=True)
class SifPartition:
    """The root file system of a SIF image: a squashfs at `offset`, `size` bytes."""

    offset: int
    size: int
    digest: str  # "sha256:<hex>" of the partition's bytes


def is_sif(path: str) -> bool:
    """Whether the file at `path` starts as a SIF file does (False if unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return False
    return len(head) == _HEADER.size and head[32:32 + len(MAGIC)] == MAGIC


def read_sif(path: str) -> SifPartition:
    """The partition to unpack (module docstring); SandboxImageError naming `path` for
    a file that is not a well-formed SIF image with a squashfs system partition."""
    try:
        with open(path, "rb") as f:
            return read_sif_file(f, path)
    except OSError as e:
        raise SandboxImageError(f"image {path}: cannot read it ({e})") from e


def read_sif_file(f: BinaryIO, path: str) -> SifPartition:
    """`read_sif` of an open file (`path` names it in errors; OSError passes through)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[32:32 + len(MAGIC)] != MAGIC:
        raise SandboxImageError(f"image {path}: not a SIF file (no SIF_MAGIC)")
    (_, _, _, _, _, _, _, _, total, table_at, _, _, _) = _HEADER.unpack(head)
    if not 0 < total <= MAX_DESCRIPTORS or table_at < _HEADER.size or \
            table_at + total * _DESCRIPTOR.size > size:
        raise SandboxImageError(f"image {path}: a damaged SIF header ({total} "
                                f"descriptors at byte {table_at} of {size})")
    f.seek(table_at)
    table = f.read(total * _DESCRIPTOR.size)
    systems: list[tuple[int, int, int, int]] = []  # (partition type, fs type, offset, size)
    for i in range(total):
        kind, used, _, _, _, offset, length, *_, extra = _DESCRIPTOR.unpack_from(
            table, i * _DESCRIPTOR.size)
        if not used or kind != DATA_PARTITION:
            continue
        fs_type, part_type, _ = _PARTITION.unpack_from(extra)
        if part_type in (PART_SYSTEM, PART_PRIMARY_SYSTEM):
            if offset < table_at + len(table) or length <= 0 or offset + length > size:
                raise SandboxImageError(f"image {path}: its system partition lies outside "
                                        f"the file (bytes {offset}-{offset + length} of {size})")
            systems.append((part_type, fs_type, offset, length))
    primary = [s for s in systems if s[0] == PART_PRIMARY_SYSTEM]
    chosen = primary or systems
    if len(chosen) != 1:
        raise SandboxImageError(f"image {path}: a SIF file with {len(chosen)} system "
                                "partitions; treadle runs one with exactly one (or one "
                                "primary)")
    _, fs_type, offset, length = chosen[0]
    if fs_type != FS_SQUASHFS:
        what = {FS_EXT3: "ext3", FS_ENCRYPTED_SQUASHFS: "an encrypted squashfs"}.get(
            fs_type, f"file system type {fs_type}")
        raise SandboxImageError(f"image {path}: its system partition is {what}; treadle "
                                "unpacks a plain squashfs only")
    digest = hashlib.sha256()
    f.seek(offset)
    left = length
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            raise SandboxImageError(f"image {path}: its system partition ends early")
        digest.update(chunk)
        left -= len(chunk)
    return SifPartition(offset, length, "sha256:" + digest.hexdigest())
