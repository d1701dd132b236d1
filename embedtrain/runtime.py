"""Process-level settings of a training process: intra-op threads per rank, the allocator, start time.

Imports nothing heavy (no torch at import): the CLI calls :func:`tune_allocator` before anything
allocates, and ``--help``, ``ingest`` and ``datagen`` stay torch-free.

**Threads.** Each rank's torch intra-op threads default to the cores this process may run on
(``os.sched_getaffinity``) divided by the ranks on this machine (torchrun's
``LOCAL_WORLD_SIZE``): two ranks on two cores get one thread each instead of two each fighting for
both. ``train.threads_per_rank`` in the config, else the environment variable
``EMBEDTRAIN_THREADS``, overrides it (:func:`threads_per_rank`).

**The allocator.** glibc serves allocations above a dynamic threshold (128 KiB at first, up to
32 MiB) with fresh ``mmap`` regions and gives them back on ``free``; the next allocation of the same
size then page-faults every page again, and the kernel zeroes each one. A training step allocates
and frees the same large buffers every step (a batch's KJT, pooled embeddings, gathered class
rows, activations), so that cost recurs each step: a step whose pooled output is over 32 MiB
faults all of its pages every step. :func:`tune_allocator` serves every block from the heap
(``M_MMAP_MAX`` 0), keeps the heap's free top mapped (``M_TRIM_THRESHOLD`` 2 GiB), both through
``mallopt`` (what the ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` variables do at start-up,
applied in-process so that every ``embedtrain`` process, each torchrun rank included, gets it),
and asks torch's CPU allocator for transparent huge pages on blocks of 2 MiB or more
(``THP_MEM_ALLOC_ENABLE=1``, read at torch's first allocation: set before torch is imported), so
that random rows of a large table miss the TLB less. Peak memory is unchanged (the blocks are
the same); resident memory stays at the peak instead of shrinking between steps (an explicit
``malloc_trim``, as the exporter calls between tables, still returns it). ``EMBEDTRAIN_MALLOC=
default`` keeps glibc's and torch's defaults; ``MALLOC_*`` / ``GLIBC_TUNABLES`` / ``LD_PRELOAD``
set by the user win. Where a rank's tables and heads fill a large share of its memory,
:func:`fit_allocator` (called after sharding) maps large blocks again and returns them when freed:
a kept heap would grow with the step's varying buffers into the memory the run does not have.
Figures: ``benchmarks/bench_allocator.py``, ``benchmarks/bench_roofline.py``,
``benchmarks/bench_xc_memory.py``.

Example:
    >>> tune_allocator()
    'glibc: no mmap per block, heap kept (trim threshold 2 GiB); torch: huge pages ...'
    >>> threads_per_rank(None)  # 2 cores, 2 ranks on this machine
    (1, 'cores / local ranks = 2 / 2')
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from typing import Optional

_IMPORTED_AT = time.time()
_MARKS: dict[str, float] = {}
# where this process's current run's start-up is counted from (None: the process's start)
_RUN_STARTED_AT: Optional[float] = None
_RUNS = 0  # runs begun in this process (begin_run)
_SETTINGS: dict[str, str] = {}

TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, 2 GiB of free heap top kept
# a rank whose tables and heads hold more than this share of its memory maps large blocks
LARGE_SHARE = 0.25
MMAP_THRESHOLD = 1 << 20  # then blocks of 1 MiB or more are mapped, and unmapped when freed
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt parameters (malloc.h)
_GLIBC_MMAP_MAX, _GLIBC_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults
_TUNED = "glibc: no mmap per block"
_USER_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                     "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def tune_allocator() -> str:
    """Keeps glibc's large blocks in the heap (module docstring); says what it did.

    Returns:
        One line for the run's banner: the settings, or why none were made (also kept for
        :func:`allocator_setting`).
    """
    _SETTINGS["allocator"] = _tune_allocator()
    return _SETTINGS["allocator"]


def allocator_setting() -> str:
    """What :func:`tune_allocator` did in this process (``"unchanged"`` if it never ran)."""
    return _SETTINGS.get("allocator", "unchanged")


def _tune_allocator() -> str:
    if os.environ.get("EMBEDTRAIN_MALLOC", "").lower() in ("default", "off", "0"):
        return "glibc defaults (EMBEDTRAIN_MALLOC=default)"
    user = [v for v in _USER_MALLOC_VARS if os.environ.get(v)]
    if user:
        return f"as set by {', '.join(user)}"
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch reads it at its first allocation
    huge = "torch: huge pages for blocks >= 2 MiB"
    libc = _glibc()
    if libc is None:
        return f"not glibc: unchanged; {huge}"
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return f"glibc refused mallopt: unchanged; {huge}"
    return (f"{_TUNED}, heap kept (trim threshold 2 GiB); {huge} "
            f"(EMBEDTRAIN_MALLOC=default: the defaults)")


def fit_allocator(held_bytes: int) -> str:
    """Gives freed large blocks back where this rank's tables and heads fill its memory.

    Keeping every block in the heap (:func:`tune_allocator`) pays where a step's buffers are
    small next to memory; where the sharded state is a large share of it (a 50M-class head), the
    step's buffers of varying sizes (sampled rows, logits) are not reused exactly, the kept heap
    grows by gigabytes and can take the machine's last memory. Above ``LARGE_SHARE`` of this
    rank's share of memory (the machine's or its cgroup's, over the ranks on this machine),
    blocks of ``MMAP_THRESHOLD`` or more are mapped and returned when freed (glibc's fixed mmap
    threshold, as ``MALLOC_MMAP_THRESHOLD_=1048576`` at start-up), and the heap is trimmed now.
    Nothing changes where :func:`tune_allocator` made no settings (the user's or the defaults).

    Args:
        held_bytes: what this rank holds after sharding (tables, heads, their optimizer state).

    Returns:
        The allocator's line for the run's banner (also :func:`allocator_setting`).
    """
    setting = allocator_setting()
    memory = rank_memory_bytes()
    if not setting.startswith(_TUNED) or memory is None or held_bytes <= LARGE_SHARE * memory:
        return setting
    libc = _glibc()
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
                            and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                            and libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD)):
        return setting
    libc.malloc_trim(0)
    _SETTINGS["allocator"] = (
        f"glibc: blocks >= 1 MiB mapped and returned when freed (tables and heads "
        f"{held_bytes / 2**30:.1f} GiB, {held_bytes / memory:.0%} of this rank's "
        f"{memory / 2**30:.1f} GiB); torch: huge pages for blocks >= 2 MiB")
    return _SETTINGS["allocator"]


def rank_memory_bytes() -> Optional[int]:
    """This rank's share of memory: the machine's (or its cgroup's limit, if lower) over the
    ranks on this machine; ``None`` where unknown."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            value = f.read().strip()
        if value.isdigit():
            limits.append(int(value))
    except OSError:
        pass
    return min(limits) // local_ranks() if limits else None


def release_freed_memory() -> None:
    """Hands the heap's freed pages back to the OS (glibc's ``malloc_trim``; elsewhere a no-op).

    A block below glibc's (self-raising) mmap threshold is allocated on the heap; freed, its
    pages would stay resident and add to the next, larger block's (the exporter's shards).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it (musl, macOS: no mallopt of these)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; ``os.cpu_count()`` where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_ranks() -> int:
    """Ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 when launched plainly)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def threads_per_rank(requested: Optional[int] = None,
                     ranks: Optional[int] = None) -> tuple[int, str]:
    """The intra-op threads of this rank and where the number comes from.

    Args:
        requested: ``train.threads_per_rank`` of the config (None: not set).
        ranks: the ranks on this machine (None: this process's, :func:`local_ranks`).

    Returns:
        ``(threads, source)``; ``source`` says why, for the banner.

    Raises:
        ValueError: ``EMBEDTRAIN_THREADS`` is not a positive integer.
    """
    if requested is not None:
        return requested, "train.threads_per_rank"
    env = os.environ.get("EMBEDTRAIN_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"EMBEDTRAIN_THREADS: expected a positive integer, got {env!r}")
        return int(env), "EMBEDTRAIN_THREADS"
    cores, ranks = usable_cores(), ranks or local_ranks()
    return max(1, cores // ranks), f"cores / local ranks = {cores} / {ranks}"


def loader_threads(requested: Optional[int], accelerated: bool, torch_threads: int) -> int:
    """Background loader threads of a rank: ``data.num_workers``, or derived where it is ``auto``.

    Derived: 0 on a CPU-only rank whose torch intra-op threads already take every core it has
    (the default, :func:`threads_per_rank`): the reader then runs in the training thread, between
    steps, helped by one read-ahead thread in the idle scheduling class (:func:`idle_read_ahead`);
    else 2. A normal loader thread beside such a step can only run by preempting one of the
    step's threads, and the others then wait for it at the next barrier
    (``benchmarks/bench_train_loop.py``, ``benchmarks/RESULTS.md``). With an accelerator, or cores
    to spare, threads overlap reading with the step.

    Args:
        requested: ``data.num_workers`` (None: auto).
        accelerated: the step runs on a GPU.
        torch_threads: this rank's intra-op threads (``torch.get_num_threads()``).
    """
    if requested is not None:
        return requested
    if not accelerated and torch_threads * local_ranks() >= usable_cores():
        return 0
    return 2


def idle_read_ahead(requested: Optional[int], threads: int) -> bool:
    """Whether the reader reads ahead in an idle-class thread: where ``data.num_workers`` is
    ``auto`` and :func:`loader_threads` gave 0 (an explicit 0 reads in the training thread only)."""
    return requested is None and threads == 0


def process_start_time() -> float:
    """When this process started (seconds since the epoch; from /proc, else this module's import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return _IMPORTED_AT


def begin_run() -> None:
    """A run begins in this process: its start-up counts from the process's start when it is the
    process's first run and the command line started it (``embedtrain train`` marked
    ``imports``), else from now, with no marks of an earlier run (a search's trial in a reused
    worker, a run started from a notebook)."""
    global _RUN_STARTED_AT, _RUNS
    _RUNS += 1
    if _RUNS > 1 or "imports" not in _MARKS:
        _RUN_STARTED_AT = time.time()
        _MARKS.clear()


def mark(name: str) -> None:
    """Records that start-up reached ``name`` now (see :func:`startup_record`)."""
    _MARKS.setdefault(name, time.time())


def startup_record(first_step: float) -> dict[str, object]:
    """``startup_s`` (process start, or :func:`begin_run`'s, to ``first_step``, a
    ``time.time()``) and its parts.

    The parts are the seconds between consecutive marks (:func:`mark`), in order, the last one
    ending at ``first_step``: e.g. ``{"imports_s": 0.3, "build_s": 4.1, "first_batch_s": 0.2}``
    when the CLI marked ``imports`` and ``build`` and the trainer ``first_batch``.
    """
    start = process_start_time() if _RUN_STARTED_AT is None else _RUN_STARTED_AT
    parts, previous = {}, start
    for name, at in sorted(_MARKS.items(), key=lambda item: item[1]):
        if at <= first_step:
            parts[f"{name}_s"] = round(at - previous, 3)
            previous = at
    parts["first_batch_s"] = round(first_step - previous, 3)
    return {"startup_s": round(first_step - start, 3), "startup": parts}


def peak_rss_gb_per_rank() -> list[float]:
    """Every rank's peak resident memory so far (GiB), gathered (a collective).

    From ``VmHWM`` in ``/proc/self/status``: ``ru_maxrss`` is inherited across fork + exec, so a
    run started by a big process would report its launcher's peak.
    """
    import torch.distributed as dist

    mine = _peak_rss_gb()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    every = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _peak_rss_gb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**20, 3)  # kB
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
