"""A file of OUT read or mapped only while it is the one the loader was made with, and mapped with no
descriptor kept.

Checks: each file's size is checked against meta when the loader is made, and its device, inode, size
and modification time recorded; a file is mapped or read only through a descriptor whose fstat shows
the same four, else a ValueError names it (a file replaced since: never zeros or other memory, which a
map of a file replaced by a smaller one gave). A live map keeps the file it was made of: replaced
meanwhile, the map still reads the bytes that were checked. The limit is a file changed in place under
a live map: truncated, a read past its new end is a SIGBUS (as for any reader that maps: np.memmap
too); rewritten at its size, reads see the new bytes. tokpipe never writes a finished OUT; `tokpipe
verify` proves its bytes.

Maps: made with libc's mmap through ctypes, the descriptor closed at once. Python's mmap keeps a dup of
the descriptor for the map's life (until 3.13's trackfd=False): two a file held, so `ulimit -n` capped
the maps (EMFILE under 128 at 64 files). Here one descriptor at most is open, while a file is mapped or
read. An array over a map keeps it (its base); the map is unmapped when the last array over it goes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MAP_FAILED = ctypes.c_void_p(-1).value


def kernel_max_maps() -> int:
    """The most maps a process may hold (vm.max_map_count)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # the kernel's default


def recorded(path: Path, size: int, what: str) -> tuple[int, int, int, int]:
    """The file's (device, inode, size, modification time), once its size is the one meta gives."""
    try:
        status = path.stat()
    except FileNotFoundError:
        raise ValueError(f"{path} is missing though meta lists it: the output is damaged (tokpipe verify)") from None
    if status.st_size != size:
        raise ValueError(
            f"{path} holds {status.st_size:,} bytes, meta says {what}: the file is not the one meta describes "
            f"(tokpipe verify)"
        )
    return _identity(status)


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def opened(path: Path, seen: tuple) -> int:
    """A descriptor of the file, when it is still the one recorded (`seen`); else a ValueError naming it and
    what changed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError(f"{path} is gone since the loader was made: reopen it on a finished output") from None
    now = _identity(os.fstat(fd))
    if now == seen:
        return fd
    os.close(fd)
    change = (
        f"{now[2]:,} bytes, {seen[2]:,} then"
        if now[2] != seen[2]
        else "another file of its size"
        if now[:2] != seen[:2]
        else "its size, but modified"
    )
    raise ValueError(
        f"{path} changed since the loader was made ({change}): reopen it on a finished output (tokpipe verify)"
    )


def read(path: Path, seen: tuple, dtype: np.dtype) -> np.ndarray:
    """The whole file, checked, read into memory."""
    with open(opened(path, seen), "rb") as f:
        return np.fromfile(f, dtype)


class _At:
    """An array interface to `shape` items of `dtype` at `address`, read-only: np.asarray of it is an array
    there whose base is this object."""

    def __init__(self, address: int, shape: tuple, dtype: np.dtype):
        self.__array_interface__ = {"data": (address, True), "shape": shape, "typestr": dtype.str, "version": 3}


class _Mapping(_At):
    """A file's pages mapped read-only, unmapped when the last array over them goes."""

    def __init__(self, address: int, size: int, dtype: np.dtype):
        super().__init__(address, (size // dtype.itemsize,), dtype)
        self.address, self.size = address, size

    def __del__(self):
        _libc.munmap(self.address, self.size)


def array_at(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An array over memory that nothing here keeps: read it only where something else keeps it mapped."""
    return np.asarray(_At(address, shape, np.dtype(dtype)))


def mapped(path: Path, seen: tuple, dtype: np.dtype, random: bool = False) -> np.ndarray:
    """A read-only array over the file's pages, when it is still the one recorded; no descriptor kept. (A
    plain ndarray: slicing an np.memmap costs 2x, its __array_finalize__.) random: madvise(MADV_RANDOM)."""
    fd = opened(path, seen)
    try:
        if seen[2] == 0:  # mmap cannot map an empty file
            return np.zeros(0, dtype)
        address = _libc.mmap(None, seen[2], mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address in (None, MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, f"cannot map it: {os.strerror(error)}", str(path))
    if random:
        _libc.madvise(address, seen[2], mmap.MADV_RANDOM)
    return np.asarray(_Mapping(address, seen[2], np.dtype(dtype)))
