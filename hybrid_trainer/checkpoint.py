"""Checkpoint files that are atomic and verified, and RNG capture, so a crash never leaves a
half-written file, a damaged file is refused instead of loaded, and a resumed run draws the same
random numbers as the uninterrupted one.

File format (written by :func:`atomic_save`, read by :func:`load`): the bytes of ``torch.save``
(a zip archive), then a 48-byte trailer: the SHA-256 of those bytes (32), their length (8,
little-endian) and the magic ``HYBCKPT1`` (8). ``torch.load`` still reads such a file directly (a
zip reader finds its directory from the end and skips trailing bytes), but only :func:`load`
checks the digest: torch does not verify the zip's CRC-32s, so one flipped bit in tensor data
otherwise loads silently as a wrong weight.

Durability: the file is written under a temporary name in the same folder, fsynced, renamed over
the target (``os.replace``, atomic) and the folder is fsynced, so the rename itself survives a
power cut. Temporary files left by a save that died (``kill -9``, power loss) are removed by the
next save of the same target.
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import random
import re
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch


def capture_rng() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_plain_to_numpy_state(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state_to_plain(state) -> list:
    kind, keys, pos, has_gauss, cached = state
    return [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)]


def _plain_to_numpy_state(plain) -> tuple:
    kind, keys, pos, has_gauss, cached = plain
    return kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def _to_tuple(value):
    return tuple(_to_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# --------------------------------------------------------------------------------------------
# Integrity trailer
# --------------------------------------------------------------------------------------------
_MAGIC = b"HYBCKPT1"
_TRAILER = struct.Struct("<32sQ8s")  # SHA-256 of the payload, payload length in bytes, magic
_CHUNK = 4 << 20  # bytes read per step while hashing a file on load


class CorruptCheckpointError(ValueError):
    """A checkpoint file whose content does not match the digest written with it, or that cannot
    be read at all (truncated, overwritten). The message names the file."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without an integrity trailer (written by ``torch.save`` directly, or before
    digests were added) was loaded without verification."""


class _HashingWriter:
    """Forwards ``torch.save``'s writes to ``file`` and hashes them on the way: the digest costs no
    second pass over the data and no copy of it."""

    def __init__(self, file) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.length += memoryview(data).nbytes  # bytes, whatever the buffer's item format
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


class _Prefix(io.RawIOBase):
    """The first ``length`` bytes of an unbuffered binary file, as a seekable stream: what
    ``torch.load`` reads, so it never sees the trailer. Reads go straight into torch's buffers
    (``readinto``), no intermediate copy."""

    def __init__(self, file, length: int) -> None:
        super().__init__()
        self._file, self._length, self._position = file, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._file.seek(self._position)
        got = self._file.readinto(memoryview(buffer).cast("B")[:count])
        self._position += got
        return got


def _verified_payload_length(file, path: Path) -> int | None:
    """Check the trailer's digest against the file's data; return the data's length, or None for
    a file without a trailer. Raises :class:`CorruptCheckpointError` naming ``path``."""
    size = os.fstat(file.fileno()).st_size
    if size == 0:
        raise CorruptCheckpointError(f"checkpoint {str(path)!r} is empty")
    if size < _TRAILER.size:
        return None
    file.seek(size - _TRAILER.size)
    digest, length, magic = _TRAILER.unpack(file.read(_TRAILER.size))
    if magic != _MAGIC:
        return None
    if length != size - _TRAILER.size:
        raise CorruptCheckpointError(f"checkpoint {str(path)!r} is truncated or damaged: its trailer says {length} "
                                     f"bytes of data, the file holds {size - _TRAILER.size}")
    sha256, remaining, buffer = hashlib.sha256(), length, bytearray(min(_CHUNK, max(length, 1)))
    view = memoryview(buffer)
    file.seek(0)
    while remaining:
        got = file.readinto(view[:min(len(buffer), remaining)])
        if not got:
            raise CorruptCheckpointError(f"checkpoint {str(path)!r} ended while reading its data")
        sha256.update(view[:got])
        remaining -= got
    if sha256.digest() != digest:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r} is corrupted: the SHA-256 of its {length} bytes of data is "
            f"{sha256.hexdigest()[:16]}..., the digest saved with it is {digest.hex()[:16]}...; refusing to load it")
    return length


# --------------------------------------------------------------------------------------------
# Temporary files
# --------------------------------------------------------------------------------------------
# .<target name>.<pid of the writer>.<mkstemp's 8 random characters>.tmp; before writer pids were
# in the name: .<target name>.<8 random characters>.tmp
_TEMP_REST = re.compile(r"(?:(?P<pid>\d+)\.)?[a-z0-9_]{8}\.tmp")


def _process_alive(pid: int) -> bool:
    if os.name != "posix":  # no signal-0 probe (os.kill would terminate the process): assume alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, ValueError):  # not a possible pid
        return False
    return True


def _remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete temporary files of earlier saves of ``path`` whose writer is gone: a pid that no longer
    runs, this process's own pid (a dead process's pid reused: this process is not writing one), or
    no pid (the older naming). A file whose writer runs may be a save in progress and is kept.
    Only names of exactly this target's pattern match (``ck.pt`` never touches ``ck.pt.rank0``'s).
    Two threads of one process saving the same target at once are not supported (each would take
    the other's file for stale). Returns the paths removed."""
    prefix = f".{path.name}."
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = _TEMP_REST.fullmatch(entry.name[len(prefix):])
        if match is None:
            continue
        pid = match.group("pid")
        if pid is not None and int(pid) != os.getpid() and _process_alive(int(pid)):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except FileNotFoundError:  # another save cleaned it first
            pass
    return removed


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories cannot be opened or
    synced (Windows; some network file systems answer EINVAL)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Save and load
# --------------------------------------------------------------------------------------------
def atomic_save(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically, with a SHA-256 of the data appended (format in
    the module docstring): a temporary file in the same folder is written while hashed, fsynced,
    renamed over ``path``, then the folder is fsynced. Stale temporary files of earlier saves of
    ``path`` are removed first. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.write(_TRAILER.pack(writer.sha256.digest(), writer.length, _MAGIC))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)
    return path


# Plain-data classes some third-party optimizers keep in their state (low-rank projectors of
# GaLore and APOLLO: tensors and numbers in their attributes), allowed when their package is
# installed so a checkpoint of such an optimizer loads with weights_only=True.
OPTIMIZER_STATE_CLASSES = (("galore_torch.galore_projector", "GaLoreProjector"),
                           ("apollo_torch.random_projector", "GradientProjector"),
                           ("apollo_torch.svd_projector", "GaLoreProjector"))


def _optimizer_state_classes() -> list[type]:
    import importlib
    import sys

    found = []
    for module_name, name in OPTIMIZER_STATE_CLASSES:
        if module_name.split(".")[0] in sys.modules:  # only packages the run already uses
            try:
                found.append(getattr(importlib.import_module(module_name), name))
            except (ImportError, AttributeError):
                pass
    return found


def load(path: str | os.PathLike, map_location=None):
    """Load a checkpoint written by :func:`atomic_save` (tensors, numbers, strings, containers and
    the optimizer-state classes of :data:`OPTIMIZER_STATE_CLASSES` only: ``weights_only`` loading,
    so a pickle that would run code is refused).

    The data is hashed and compared with the digest saved with it before anything is unpickled.
    Raises :class:`CorruptCheckpointError` (naming the file) on a mismatch, a truncated file or one
    torch cannot read. A file without the trailer (plain ``torch.save``, or written before digests
    existed) loads with an :class:`UnverifiedCheckpointWarning`: it cannot be verified, and refusing
    it would strand every older checkpoint.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as file:
        length = _verified_payload_length(file, path)
        if length is None:
            warnings.warn(f"checkpoint {str(path)!r} has no integrity digest (written by torch.save directly or "
                          "before digests were added): loading it unverified", UnverifiedCheckpointWarning,
                          stacklevel=2)
            length = os.fstat(file.fileno()).st_size
        stream = io.BufferedReader(_Prefix(file, length), buffer_size=1 << 16)
        try:
            with torch.serialization.safe_globals(_optimizer_state_classes()):
                return torch.load(stream, map_location=map_location, weights_only=True)
        except (RuntimeError, EOFError) as error:  # torch's zip reader: not a (complete) checkpoint
            raise CorruptCheckpointError(f"checkpoint {str(path)!r} cannot be read: {error}") from error
