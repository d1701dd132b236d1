"""The resident memory of a process tree, sampled while a command runs (Linux ``/proc``).

:class:`RSSSampler` polls every process under a root pid (``VmRSS``; and the tree's ``RssAnon``,
its own memory without the pages of files it memory-maps, which the kernel can drop), keeps each
one's peak and the torchrun rank in its environment, the machine's lowest ``MemAvailable``, and when paths
matching given patterns first appear (e.g. a run's checkpoint and summary files, to time the
phases of a run that logs no times of its own). :func:`run_sampled` runs a command under it.

Example:
    >>> status, wall_s, memory = run_sampled(["sleep", "1"], Path("/tmp/sleep.log"))
    >>> memory["peak_tree_rss_gb"] < 0.1
    True
"""

from __future__ import annotations

import glob
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


class RSSSampler:
    """Samples the resident memory of a process tree (and MemAvailable) in a thread.

    ``watch`` (name -> glob pattern): ``seen[name]`` is when a matching path was first seen, in
    seconds since the sampler started. Each rank's resident memory over time is kept where it
    moved by 50 MiB or more since the last point kept (``rss_timeline_by_rank``: ``[s, GiB]``),
    with the time of its peak.
    """

    def __init__(self, root_pid: int, every_s: float = 0.5,
                 watch: Optional[dict[str, str]] = None) -> None:
        self.root, self.every = root_pid, every_s
        self.watch = dict(watch or {})
        self.seen: dict[str, float] = {}
        self._start = time.perf_counter()
        self.peak: dict[int, tuple[float, str]] = {}  # pid -> (max GiB, command line)
        self.rank: dict[int, int] = {}  # pid -> RANK of a torchrun worker
        self.peak_at: dict[int, float] = {}  # pid -> seconds since start of its peak
        self.timeline: dict[int, list[tuple[float, float]]] = {}  # pid -> kept (s, GiB)
        self.peak_total_gb = 0.0
        self.peak_anon_gb = 0.0  # RssAnon: the tree's own memory, without mapped file pages
        self.min_available_gb = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def _sample(self) -> None:
        total = anon = 0.0
        for pid in self._tree():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            rss = next((int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("VmRSS:")), 0) / 2**20
            total += rss
            anon += next((int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("RssAnon:")), 0) / 2**20
            now = round(time.perf_counter() - self._start, 2)
            if rss > self.peak.get(pid, (0.0, ""))[0]:
                self.peak[pid] = (rss, cmd[:160])
                self.peak_at[pid] = now
            if pid not in self.rank:
                self.rank[pid] = _env_rank(pid)
            if self.rank[pid] >= 0:
                line = self.timeline.setdefault(pid, [])
                if not line or abs(rss - line[-1][1]) >= 50 / 1024:
                    line.append((now, round(rss, 3)))
        self.peak_total_gb = max(self.peak_total_gb, total)
        self.peak_anon_gb = max(self.peak_anon_gb, anon)
        meminfo = Path("/proc/meminfo").read_text()
        available = next(int(line.split()[1]) for line in meminfo.splitlines()
                         if line.startswith("MemAvailable:")) / 2**20
        self.min_available_gb = min(self.min_available_gb, available)

    def _look(self) -> None:
        for name, pattern in self.watch.items():
            if name not in self.seen and glob.glob(pattern):
                self.seen[name] = round(time.perf_counter() - self._start, 3)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._sample()
            self._stop.wait(self.every)
        self._look()

    def report(self) -> dict[str, Any]:
        top = sorted(self.peak.items(), key=lambda kv: -kv[1][0])[:4]
        ranks: dict[int, int] = {}  # rank -> its process of highest peak (children share RANK)
        for pid, r in self.rank.items():
            if r >= 0 and pid in self.peak and (
                    r not in ranks or self.peak[pid][0] > self.peak[ranks[r]][0]):
                ranks[r] = pid
        return {"peak_tree_rss_gb": round(self.peak_total_gb, 3),
                "peak_tree_anon_gb": round(self.peak_anon_gb, 3),
                "min_mem_available_gb": round(self.min_available_gb, 3),
                "sample_every_s": self.every, "first_seen_s": self.seen,
                "peak_rss_gb_by_rank": [round(self.peak[ranks[r]][0], 3) for r in sorted(ranks)],
                "peak_rss_at_s_by_rank": [self.peak_at[ranks[r]] for r in sorted(ranks)],
                "rss_timeline_by_rank": [self.timeline.get(ranks[r], []) for r in sorted(ranks)],
                "peak_rss_gb_by_process": [{"pid": pid, "rss_gb": round(rss, 3), "cmd": cmd}
                                           for pid, (rss, cmd) in top]}


def _env_rank(pid: int) -> int:
    """``RANK`` in a process's environment (torchrun workers), -1 if none."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)


def run_sampled(cmd: list[str], log: Path, every_s: float = 0.5,
                watch: Optional[dict[str, str]] = None) -> tuple[int, float, dict[str, Any]]:
    """Runs ``cmd`` in the repository root under an :class:`RSSSampler`.

    Args:
        cmd: the command line.
        log: file for its stdout and stderr.
        every_s: seconds between samples.
        watch: name -> glob pattern, reported under ``first_seen_s``.

    Returns:
        ``(exit status, wall seconds, the sampler's report)``.
    """
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        with RSSSampler(proc.pid, every_s, watch) as sampler:
            status = proc.wait()
    return status, time.perf_counter() - start, sampler.report()
