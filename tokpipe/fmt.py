"""How numbers are written for people, the same by the run (its progress lines) and by the readers
(status, report): durations, sizes, and the disk line that says whether the output fits."""

from __future__ import annotations

import os


def duration(seconds: float) -> str:
    """42s, 7m03s, 2h05m, 3d04h: readable at a glance, for ETAs of minutes or of days."""
    s = int(round(seconds))
    for big, big_s, small, small_s in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= big_s:
            return f"{s // big_s}{big}{s % big_s // small_s:02d}{small}"
    return f"{s}s"


def size(n: float) -> str:
    """4.7 MB, 2.50 TB: decimal units, as disks are sold and df -H shows."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}" if scale == 1e12 else f"{n / scale:,.1f} {unit}"
    return f"{n / 1e3:,.1f} kB"


def plural(n: int, what: str) -> str:
    """1,024 shards, 1 shard."""
    return f"{n:,} {what}{'s' if n != 1 else ''}"


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on path's file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def held_bytes(folder: str | os.PathLike) -> int:
    """Bytes the files under folder take on its file system: their blocks, so a split file written at its
    shards' offsets counts what is written, not its length."""
    held = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                held += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except FileNotFoundError:  # removed by the run meanwhile
                pass
    return held


def disk_now(projected_bytes: int, out: str | os.PathLike) -> dict:
    """The output's projected size beside OUT's disk as it is now: what OUT holds, what is still to write (what it
    does not hold yet), the free space. Not the tokens of the input still unread: those of the shards read but not
    yet placed (up to one a worker, each shard of a few large ones) are to write too, and leaving them out said
    "fits" of a 4.6 MB output on a 3 MB disk."""
    held = held_bytes(out)
    to_write = max(projected_bytes - held, 0)
    return {
        "projected_bytes": projected_bytes,
        "held_bytes": held,
        "to_write_bytes": to_write,
        "free_bytes": free_bytes(out),
    }


def disk_line(disk: dict, tokens_per_byte: float | None = None, input_bytes: int = 0, itemsize: int = 0) -> str:
    """Whether the output fits (disk_now): its projected size, what is still to write, the free space."""
    how = ""
    if tokens_per_byte is not None:
        how = f" ({tokens_per_byte:.3f} tokens per input byte so far x {size(input_bytes)} of input x {itemsize} bytes)"
    fits = disk["to_write_bytes"] <= disk["free_bytes"]
    verdict = (
        "fits"
        if fits
        else f"WILL NOT FIT: free {size(disk['to_write_bytes'] - disk['free_bytes'])} more, or use another --out; "
        "a full disk stops the run, and rerunning the same command resumes it"
    )
    return (
        f"disk: output projected at {size(disk['projected_bytes'])}{how}; {size(disk['to_write_bytes'])} still to"
        f" write, {size(disk['free_bytes'])} free on OUT's file system: {verdict}"
    )
