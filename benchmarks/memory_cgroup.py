"""A hard memory limit for a benchmark and its children: a Linux memory cgroup (v1 or v2).

``MemoryLimit(gib)`` makes a cgroup with that limit and moves the calling process into it, so
every command it starts afterwards runs under the limit too. The kernel counts a cgroup's
anonymous memory *and* the page cache its processes fill (the pages of memory-mapped files
included), and reclaims clean file pages when the limit is reached rather than failing: a job
that finishes under the limit ran on a machine of that size, whatever its ``VmRSS`` (which
counts mapped file pages the kernel could drop) said without one. Where the limit cannot be set
(no writable cgroup file system), it says so in one line.

Example:
    >>> limit = MemoryLimit(16.0)       # this process and its children, at most 16 GiB
    >>> limit.evict(Path("data"))        # the next step's reads are charged to the limit
    >>> limit.reset_peak()
    >>> ...                             # run a step
    >>> limit.usage()                   # {"limit_gb": 16.0, "peak_gb": ..., "oom_kills": 0, ...}
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any, Optional

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
GIB = 2**30


class MemoryLimit:
    """This process (and its future children) in a new memory cgroup of ``gib`` GiB."""

    def __init__(self, gib: float, name: Optional[str] = None) -> None:
        self.gib = gib
        name = name or f"embedtrain_bench_{os.getpid()}"
        limit = str(int(gib * GIB))
        if (V1 / "memory.limit_in_bytes").is_file():
            self.v1, self.path = True, _own_cgroup(V1, "memory") / name
            files = {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes",
                     "usage": "memory.usage_in_bytes"}
        elif (V2 / "cgroup.controllers").is_file():
            self.v1, self.path = False, _own_cgroup(V2, "") / name
            files = {"limit": "memory.max", "peak": "memory.peak", "usage": "memory.current"}
        else:
            raise SystemExit("--memory-limit-gb: no memory cgroup file system at "
                             f"{V1} or {V2}")
        self.files = files
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / files["limit"]).write_text(limit)
            if self.v1 and (self.path / "memory.memsw.limit_in_bytes").is_file():
                try:  # no swapping past the limit either, where swap accounting is on
                    (self.path / "memory.memsw.limit_in_bytes").write_text(limit)
                except OSError:
                    pass
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            raise SystemExit(f"--memory-limit-gb: cannot set a limit at {self.path}: {e}")
        atexit.register(self.close)

    def close(self) -> None:
        """Moves this process back to the parent cgroup and removes this one (once empty)."""
        try:
            (self.path.parent / "cgroup.procs").write_text(str(os.getpid()))
            self.path.rmdir()
        except OSError:
            pass  # a child still in it: the empty cgroup stays, harmless

    def _read(self, key: str) -> int:
        return int((self.path / self.files[key]).read_text().split()[0])

    def evict(self, *folders: Path) -> int:
        """Drops the files under ``folders`` from the page cache (``POSIX_FADV_DONTNEED``; clean
        pages no process maps), so the pages the next step reads are charged to this cgroup,
        not to whichever cgroup read them first. Returns the files evicted."""
        done = 0
        for folder in folders:
            for path in [folder] if folder.is_file() else folder.rglob("*"):
                if not path.is_file():
                    continue
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages are written first (DONTNEED skips them)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                done += 1
        return done

    def reset_peak(self) -> None:
        """Starts a new peak (v1 only: v2's ``memory.peak`` keeps the cgroup's whole life)."""
        if self.v1:
            (self.path / self.files["peak"]).write_text("0")

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit so far."""
        events = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def usage(self) -> dict[str, Any]:
        """The limit, the peak since :meth:`reset_peak` (anonymous memory and page cache
        together), the usage now and the OOM kills so far, in GiB."""
        peak = self._read("peak") if (self.path / self.files["peak"]).is_file() else None
        return {"limit_gb": self.gib,
                "peak_gb": None if peak is None else round(peak / GIB, 3),
                "usage_gb": round(self._read("usage") / GIB, 3),
                "oom_kills": self.oom_kills(), "cgroup": str(self.path)}


def _own_cgroup(root: Path, controller: str) -> Path:
    """This process's cgroup of ``controller`` (``""``: v2's one hierarchy) under ``root``, so a
    new cgroup nests in it (its parent's limits still apply); ``root`` where it is not found."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or controllers == controller:
            found = root / path.lstrip("/")
            if found.is_dir():
                return found
    return root
