"""A token file of OUT read or mapped only while it is the one first seen, and mapped with no descriptor kept: the
one place where a reader of OUT touches a token file's bytes (LocalFile).

Checks: each file's size is checked against meta when a reader is made (a file a live run still writes: at
least what OUT's records cover), and its device, inode, size and modification time recorded (a growing
file's: its device and inode); a file is mapped or read only through a descriptor whose fstat shows the same,
else an OutputError (a ValueError, and a UserError for the commands) names it (a file replaced since: never
zeros or other memory, which a map of a file replaced by a smaller one gave). A live map keeps the file it was
made of: replaced meanwhile, the map still reads the bytes that were checked. The limit is a file changed in
place under a live map: truncated, a read past its new end is a SIGBUS (as for any reader that maps: np.memmap
too); rewritten at its size, reads see the new bytes. tokpipe never writes a finished OUT; `tokpipe verify`
proves its bytes.

Maps: made with libc's mmap through ctypes, the descriptor closed at once. Python's mmap keeps a dup of
the descriptor for the map's life (until 3.13's trackfd=False): two a file held, so `ulimit -n` capped
the maps (EMFILE under 128 at 64 files). Here one descriptor at most is open, while a file is mapped or
read. An array over a map keeps it (its base); the map is unmapped when the last array over it goes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shlex
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from tokpipe.durability import ShortRead, read_range
from tokpipe.layout.meta import OutputError
from tokpipe.layout.stored import stored_of
from tokpipe.store import REQUESTS_AT_ONCE, Bucket, Changed, Object

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MAP_FAILED = ctypes.c_void_p(-1).value
# Names looked up in a LIST of their folder (seen_all): 64 HEADs are 4 round trips 16 at once, a LIST page 1. The LIST
# is given up past LIST_MOST objects a name: 16 pages a 1,000 names, a quarter of their HEADs' round trips.
LISTED = 64
LIST_MOST = 16
_LISTING = threading.Lock()


def kernel_max_maps() -> int:
    """The most maps a process may hold (vm.max_map_count)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # the kernel's default


def _unlike(path: str, found: int | None, size: int, what: str, growing: bool, out: str) -> OutputError | None:
    """The refusal of a token file (of `found` bytes; None: missing) that does not hold the `size` bytes OUT's records
    say (`what`, in words): exactly, or (`growing`: an unfinished OUT's, which a live run may still write, or a range
    of a segment) at least."""
    verify = f"tokpipe verify {shlex.quote(out)}"
    if growing:  # an unfinished OUT: its checkpoints and parts lists say what it holds
        verify, what = f"tokpipe status {shlex.quote(out)}", f"{what} that OUT's records cover"
    if found is None:
        lists = "OUT's records list" if growing else "meta lists"
        return OutputError(f"{path} is missing though {lists} it: the output is damaged ({verify})")
    if growing and found < size:
        return OutputError(f"{path} holds {found:,} bytes, fewer than {what}: the output is damaged ({verify})")
    if not growing and found != size:
        return OutputError(
            f"{path} holds {found:,} bytes, meta says {what}: the file is not the one meta describes ({verify})"
        )
    return None


@dataclass(frozen=True, slots=True)  # two a file: 60,000 files are 120,000
class LocalFile:
    """A token file of OUT on this machine, as it was first seen: read or mapped only while it is still that file.

    The reader's byte access is this: `size` and `read` (bytes [start, stop), a buffer at a time), which a file on an
    object store can give too (ranged GETs); `array` reads a range into memory through it. `mapped` is the local
    fast path, which the loader reads windows through (maps.py's docstring above)."""

    path: Path
    size: int  # the bytes it is read to, [0, size): the whole file, or (growing) what OUT's records cover of it
    seen: tuple  # (device, inode, size, modification time); a growing file's: (device, inode)

    def covering(self, size: int, growing: bool) -> LocalFile:
        """The file read to `size` (recorded); a growing one (a live run still writes it) known by its inode alone."""
        return replace(self, size=size, seen=self.seen[:2] if growing else self.seen)

    def opened(self) -> int:
        """A descriptor of the file, while it is the one first seen; else OutputError naming it and what changed."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise OutputError(
                f"{self.path} is gone since the loader was made: reopen it on a finished output"
            ) from None
        now, seen = identity(os.fstat(fd)), self.seen
        if now[: len(seen)] == seen:
            return fd
        os.close(fd)
        change = (
            "another file"  # growing: what is beyond its size may change
            if len(seen) == 2
            else f"{now[2]:,} bytes, {seen[2]:,} then"
            if now[2] != seen[2]
            else "another file of its size"
            if now[:2] != seen[:2]
            else "its size, but modified"
        )
        raise OutputError(
            f"{self.path} changed since the loader was made ({change}): reopen it on a finished output (tokpipe verify)"
        )

    def read(self, start: int, stop: int, buffer: bytearray) -> Iterator[memoryview]:
        """Bytes [start, stop) of the file, a view of `buffer` at a time (durability.read_range)."""
        fd = self.opened()
        try:
            yield from read_range(fd, start, stop, buffer)
        finally:
            os.close(fd)

    def array(self, dtype: np.dtype, first: int, count: int) -> np.ndarray:
        """Items [first, first + count) of the file, read into memory (not mapped: its pages stay reclaimable)."""
        with open(self.opened(), "rb") as f:
            found = np.fromfile(f, dtype, count, offset=first * np.dtype(dtype).itemsize)
        if len(found) < count:
            raise ShortRead(first + len(found), first + count)
        return found

    def mapped(self, dtype: np.dtype, random: bool = False, first: int = 0) -> np.ndarray:
        """A read-only array over the file's pages, its items from `first` to `size`; no descriptor kept. (A plain
        ndarray: slicing an np.memmap costs 2x, its __array_finalize__.) random: madvise(MADV_RANDOM)."""
        dtype = np.dtype(dtype)
        start = first * dtype.itemsize
        offset = start - start % mmap.ALLOCATIONGRANULARITY  # where a map may begin: at a page
        fd = self.opened()
        try:
            if self.size <= start:  # mmap cannot map an empty file, nor nothing
                return np.zeros(0, dtype)
            address = _libc.mmap(None, self.size - offset, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        finally:
            os.close(fd)
        if address in (None, MAP_FAILED):
            error = ctypes.get_errno()
            raise OSError(error, f"cannot map it: {os.strerror(error)}", str(self.path))
        if random:
            _libc.madvise(address, self.size - offset, mmap.MADV_RANDOM)
        return np.asarray(_Mapping(address, self.size - offset, start - offset, dtype))


def identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


class _At:
    """An array interface to `shape` items of `dtype` at `address`, read-only: np.asarray of it is an array
    there whose base is this object."""

    def __init__(self, address: int, shape: tuple, dtype: np.dtype):
        self.__array_interface__ = {"data": (address, True), "shape": shape, "typestr": dtype.str, "version": 3}


class _Mapping(_At):
    """A file's pages mapped read-only (`length` bytes at `address`), its items from `skip` bytes on; unmapped when
    the last array over them goes."""

    def __init__(self, address: int, length: int, skip: int, dtype: np.dtype):
        super().__init__(address + skip, ((length - skip) // dtype.itemsize,), dtype)
        self.address, self.length = address, length

    def __del__(self):
        _libc.munmap(self.address, self.length)


def array_at(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An array over memory that nothing here keeps: read it only where something else keeps it mapped."""
    return np.asarray(_At(address, shape, np.dtype(dtype)))


@dataclass(frozen=True, slots=True)
class StoreFile:
    """A token file of an OUT on an object store (layout/stored.py), as it was first seen: its ETag, which every read
    asks for (If-Match), so a file replaced since is never read as the one checked. LocalFile's access, by ranged
    GETs: `read` a range a buffer at a time (verify's hashes), `array` a range; `mapped` reads the file from `first`
    to its end into memory (a store has no map: a reader that maps, the loader, reads a local copy instead)."""

    bucket: Bucket
    key: str
    size: int
    etag: str
    path: str  # its URL, as a message names it

    def covering(self, size: int, growing: bool) -> StoreFile:
        return replace(self, size=size)

    def _get(self, start: int, stop: int) -> bytes:
        try:
            data, _ = self.bucket.read(self.key, start, stop, self.etag)
        except Changed:
            raise OutputError(f"{self.path} changed since the reader was made: reopen it (tokpipe verify)") from None
        if len(data) < stop - start:
            raise ShortRead(start + len(data), stop)
        return data

    def read(self, start: int, stop: int, buffer: bytearray) -> Iterator[memoryview]:
        """Bytes [start, stop) of the file, a GET of len(buffer) bytes at a time."""
        for at in range(start, stop, len(buffer)):
            yield memoryview(self._get(at, min(stop, at + len(buffer))))

    def array(self, dtype: np.dtype, first: int, count: int) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        if not count:  # no range to ask for
            return np.zeros(0, dtype)
        return np.frombuffer(self._get(first * itemsize, (first + count) * itemsize), dtype)

    def mapped(self, dtype: np.dtype, random: bool = False, first: int = 0) -> np.ndarray:
        return self.array(dtype, first, max(self.size // np.dtype(dtype).itemsize - first, 0))


def seen(out: Path, name: str, listed: dict[str, Object] | None = None) -> tuple[str, LocalFile | StoreFile | None]:
    """A token file of OUT by its name in OUT, as it is now: on this machine, or for a reader's copy of an OUT on a
    store's records, on the store (layout/stored.py reader_out), as its LIST found it (or `listed`), else by a HEAD.
    How a message names it, and the file, to its end (None: there is none)."""
    stored = stored_of(out)
    if stored is not None:
        listed = listed if listed is not None else getattr(out, "listed", None)
        url = str(stored.url / name)
        found = listed.get(name) if listed is not None else stored.bucket.head(stored.key(name))
        return url, found and StoreFile(stored.bucket, stored.key(name), found.size, found.etag, url)
    try:
        status = (out / name).stat()
    except FileNotFoundError:
        return str(out / name), None
    return str(out / name), LocalFile(out / name, status.st_size, identity(status))


def recorded(out: Path, name: str, size: int, what: str, growing: bool = False, found=None) -> LocalFile | StoreFile:
    """A token file of OUT (`found`: as `seen` found it), once it holds the `size` bytes OUT's records say (`what`, in
    words): exactly, or (`growing`: a file a live run still writes) at least. Else OutputError, naming it."""
    shown, file = found or seen(out, name)
    if error := _unlike(shown, file and file.size, size, what, growing, str(stored_of(out) or out)):
        raise error
    return file.covering(size, growing)


def seen_all(out: Path, names: list[str], among: list[str] = ()) -> dict[str, tuple[str, LocalFile | StoreFile | None]]:
    """`seen` of each of OUT's token files `names`, by name. On a store, where the copy holds no LIST of OUT, from a
    LIST of their folder (or of `among`'s, the files they are some of: a group's of a split's) where it holds LISTED
    names or more, a page of 1,000 objects a request (a HEAD a file: a --no-concat split of 60,000 shards was 120,000
    requests for each loader that opened it), kept in the copy for the next names of the folder; a LIST past
    LIST_MOST objects a name is given up, and the names looked up by HEADs, REQUESTS_AT_ONCE at once (each_file)."""
    stored, names, among = stored_of(out), list(dict.fromkeys(names)), list(dict.fromkeys(among or names))
    if stored is not None and getattr(out, "listed", None) is None and len(among) >= LISTED:
        folder = os.path.commonpath(among)
        with _LISTING:  # (a Mixture's groups open at once: one LIST of their split's folder)
            if folder not in out.folders:
                listed = {}
                for o in stored.bucket.list(stored.key(folder) + "/" if folder else stored.prefix):
                    listed[stored.name(o.key)] = o
                    if len(listed) > LIST_MOST * len(among):
                        listed = None
                        break
                out.folders[folder] = listed
        if out.folders[folder] is not None:
            return {name: seen(out, name, out.folders[folder]) for name in names}
    return dict(zip(names, each_file(out, partial(seen, out), names)))


def each_file(out: Path, call: Callable, files: list) -> list:
    """call(file) for each of OUT's `files`, in order: on a store REQUESTS_AT_ONCE at once (each a HEAD or a GET, a
    round trip: 4,000 HEADs one after another wait 80 s where the store answers in 20 ms), else one after another."""
    if stored_of(out) is None or len(files) < 2:
        return [call(file) for file in files]
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        return list(pool.map(call, files))
