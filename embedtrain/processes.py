"""Processes that use ``torch.distributed``: free ports, how they end, a harness spawning ranks.

Torch-free at import (the CLI imports this module for ``--help`` too): every function imports
torch when it runs.

Why a process that used gloo ends through :func:`exit_process` (found from a core dump of a
2-rank run that died with "terminate called without an active exception"): gloo runs each
collective in a worker thread of ``ProcessGroupGloo``, and that thread drops its reference to the
finished work *after* the caller's ``wait()`` has returned. When the caller has dropped the
work's tensors already (any synchronous ``all_reduce`` of a temporary), that last reference
frees Python objects and so takes the GIL. If the main thread has meanwhile reached interpreter
finalization (rank 1 has nothing left to write and gets there within milliseconds), CPython ends
every thread that asks for the GIL with ``pthread_exit`` (cpython#87135); its forced unwind
crosses the ``noexcept`` destructor ``~AsyncWork`` and libstdc++ calls ``std::terminate``.
``destroy_process_group`` does not help on its own: gloo's threads live as long as any Python
object (the sharded model, its optimizers) still references the group. So every entry point
stops its own threads (loaders, prefetchers), waits for its peers (a barrier, on success),
destroys the process group, flushes its output and leaves with ``os._exit``: the foreign C++
threads die with the process instead of being cut off inside a destructor.

:func:`spawn` runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each in a
freshly initialised gloo group on 127.0.0.1 (a free port), and returns each rank's result to the
caller (like TorchRec's ``distributed/test_utils/multi_process.py``); multi-rank tests and the
cluster calibration run their ranks with it. Each rank leaves through :func:`exit_process` (a
barrier first when it succeeded). Results travel through ``torch.save`` files in a temporary
directory (not a queue: shared-memory tensors would die with the child), so they should be small
and picklable: dicts of tensors, floats, strings. A rank that raises makes :func:`spawn`
terminate the other ranks at once (they would otherwise wait in a collective) and raise
:class:`RankError` with that rank's traceback; a run longer than ``timeout`` seconds is killed
and raises :class:`TimeoutError`. ``fn`` must be importable by the children (a module-level
function of an importable module). Ranks are forked by a ``forkserver`` that imported torch,
TorchRec and this module once (a 2-rank start: ~0.1 s, not ~5 s), each with the caller's working
directory, ``sys.path`` and environment at the call.

Example:
    >>> def _allreduce(rank, world_size, x):
    ...     t = torch.tensor([x * (rank + 1)])
    ...     torch.distributed.all_reduce(t)
    ...     return {"sum": t}
    >>> spawn(_allreduce, 2, 1.0)            # [{'sum': tensor([3.])}, {'sum': tensor([3.])}]

Signals and parent death (``embedtrain train --nproc N``: ``embedtrain`` -> torchrun ->
workers, each worker in a session of its own): :func:`run_supervised` runs torchrun in its own
process group and passes SIGTERM, SIGINT and SIGHUP on to it once (a second signal, or torchrun
still running ``grace`` seconds later, SIGKILLs torchrun and everything under it);
:func:`die_with_parent` asks Linux for a signal when the parent ends (``PR_SET_PDEATHSIG``), so
torchrun ends with ``embedtrain`` and every worker with torchrun even after a SIGKILL that no
handler sees; :func:`start_worker` is a torchrun worker's first step (dies with torchrun, and
SIGINT ends it at once as SIGTERM does: torchrun passes a signal on as it came, and a Python
``KeyboardInterrupt`` would wait for a collective to return and print once per rank).
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

_joined = False  # whether this process ever joined a process group (gloo threads may live on)


def mark_joined() -> None:
    """Records that this process joins a process group (see :func:`joined_process_group`)."""
    global _joined
    _joined = True


def joined_process_group() -> bool:
    """Whether this process joined a process group (:func:`mark_joined`; its threads may still
    run), so that it must leave through :func:`exit_process`."""
    return _joined


PARENT_PID_ENV = "EMBEDTRAIN_PARENT_PID"  # the pid a child expects as its parent (a start race)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what run_supervised passes on
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Makes Linux send ``sig`` to this process when its parent ends (``PR_SET_PDEATHSIG``).

    Closes the race of a parent that died before the call: when the parent is no longer the one
    named by ``$EMBEDTRAIN_PARENT_PID`` (set by :func:`run_supervised` and by
    :mod:`embedtrain.train.launch`; read and removed here), or is init (pid 1), this process
    sends ``sig`` to itself at once. The signal comes when the parent *thread* ends: the
    parent must start the child from a thread that lives as long as it does (its main thread).

    Returns:
        Whether the kernel took the request (False off Linux or without a usable libc).
    """
    expected = os.environ.pop(PARENT_PID_ENV, "")
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if parent == 1 or (expected.isdigit() and parent != int(expected)):  # gone already
        os.kill(os.getpid(), sig)
        os._exit(128 + int(sig))  # sig was caught or ignored: leave all the same
    return True


def start_worker() -> None:
    """A torchrun worker's first step (``LOCAL_RANK`` set): it dies with torchrun (SIGKILL when
    its parent ends), and SIGINT ends it at once as SIGTERM does (torchrun passes on the signal
    it got; its launcher says the one line)."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children first), from Linux's ``/proc/PID/task/*/children``;
    empty where that does not exist."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += [k for k in kids if k not in found]
            todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and every process under it (found before any is killed)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_supervised(cmd: Sequence[str], env: Optional[dict] = None,
                   grace: float = 8.0) -> tuple[int, Optional[int]]:
    """Runs ``cmd`` in a process group of its own until it ends, passing stop signals on.

    SIGTERM, SIGINT and SIGHUP sent to this process (or its group, which the child is not in,
    so it gets each signal once) are sent on to the child; when it is still running ``grace``
    seconds after, or a second signal comes, the child and every process under it are
    SIGKILLed. The child's environment names this process (``$EMBEDTRAIN_PARENT_PID``) for
    :func:`die_with_parent`. The signal handlers in place before are restored at the end.
    Call from the main thread.

    Returns:
        ``(status, signal)``: the child's exit status as :mod:`subprocess` gives it (negative:
        killed by that signal) and the first stop signal this process got (None if none).
    """
    import subprocess

    got: list[int] = []
    child: list[subprocess.Popen] = []
    sent: list[bool] = []

    def pass_on() -> None:  # once, the first signal, when there is a child
        if got and child and not sent:
            sent.append(True)  # before sending: a handler run in between sends nothing
            try:
                child[0].send_signal(got[0])
            except ProcessLookupError:
                pass

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        pass_on()

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        group = {"process_group": 0} if sys.version_info >= (3, 11) else \
            {"start_new_session": True}
        env = {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}
        child.append(subprocess.Popen(list(cmd), env=env, **group))
        proc = child[0]
        pass_on()  # a signal that came while the child started
        deadline = None
        while (code := proc.poll()) is None:
            if got and deadline is None:
                deadline = time.monotonic() + grace
            if deadline is not None and (len(got) > 1 or time.monotonic() > deadline):
                kill_tree(proc.pid)
                code = proc.wait()
                break
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, (got[0] if got else None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_process_group(barrier: bool = False) -> None:
    """Leaves the default process group (and every group made from it), if this process joined.

    Args:
        barrier: wait for the other ranks first (only on success: a failed peer never arrives).
    """
    if "torch.distributed" not in sys.modules:  # never imported: no group to leave
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if barrier and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int, barrier: bool = False) -> NoReturn:
    """Ends a process that may have used ``torch.distributed``: see the module docstring.

    Destroys the process group (after a barrier when ``barrier``), flushes logging, stdout and
    stderr, then exits with ``code`` without running interpreter finalization. Only for the
    outermost entry points (the CLI, spawned ranks), never inside a library call.
    """
    try:
        destroy_process_group(barrier=barrier)
    except Exception as e:  # noqa: BLE001 - exiting anyway; say why the group did not close
        print(f"embedtrain: process group not closed cleanly: {e}".splitlines()[0],
              file=sys.stderr)
        code = code or 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class RankError(RuntimeError):
    """A rank of :func:`spawn` raised (or died); the message holds its traceback.

    Attributes:
        rank: the rank that failed first.
        summary: one line saying why (``"ValueError: ..."``, or how it died).
    """

    def __init__(self, message: str, rank: int, summary: str) -> None:
        super().__init__(message)
        self.rank, self.summary = rank, summary


def _run_rank(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str,
              limits: tuple[float, float], args: tuple, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's at the call, not the fork server's at its start
    os.environ.update(env)
    out = Path(out_dir)
    failed = False
    # Where a rank hangs, for spawn's timeout message: every thread's stack, written shortly
    # before spawn gives up (only if this process is still alive then). Timed from spawn's own
    # deadline (``time.monotonic`` is one clock for every process), not from this rank's start,
    # which a loaded machine delays by seconds.
    timeout, deadline = limits
    stacks = open(out / f"rank{rank}.stacks", "w")  # noqa: SIM115 (open until the process ends)
    dump_at = deadline - min(_STACKS_BEFORE_S, timeout / 2)
    faulthandler.dump_traceback_later(max(0.1, dump_at - time.monotonic()), file=stacks)
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        torch.save(fn(rank, world_size, *args), out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:
        failed = True  # recorded before the group goes down and the peers fail in turn
        when = time.monotonic()  # one clock for all processes: orders the failures
        summary = traceback.format_exception_only(*sys.exc_info()[:2])[0].strip().splitlines()[0]
        (out / f"rank{rank}.err.tmp").write_text(f"{when}\n{summary}\n{traceback.format_exc()}")
        os.replace(out / f"rank{rank}.err.tmp", out / f"rank{rank}.err")  # whole or absent
    # Not a return into multiprocessing's interpreter exit: gloo's worker threads may still
    # release a collective's Python tensors, which aborts a finalizing interpreter (see the
    # module docstring). The group is destroyed and the process leaves at once.
    exit_process(1 if failed else 0, barrier=not failed)


_log = logging.getLogger(__name__)
_STACKS_BEFORE_S = 10.0    # a rank dumps its threads' stacks this long before spawn's deadline
_TEARDOWN_GRACE_S = 60.0   # how long ranks that all returned may take to exit


def _stacks(out: Path, ranks: list[int]) -> str:
    """The stacks the ``ranks`` dumped before the deadline, as lines after a timeout's message."""
    text = ""
    for r in ranks:
        path = out / f"rank{r}.stacks"
        dump = path.read_text().strip() if path.exists() else ""
        text += f"\nrank {r}'s threads:\n{dump}" if dump else f"\nrank {r}: no stacks dumped"
    return text


def _failure(procs: list, out: Path) -> RankError:
    """The first failure in full (a crash without traceback, else the oldest traceback): the
    others are usually peers noticing it ("Connection closed by peer")."""
    errors = {r: (out / f"rank{r}.err").read_text().split("\n", 2)
              for r in range(len(procs)) if (out / f"rank{r}.err").exists()}
    crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    first, *others = crashed + sorted(errors, key=lambda r: float(errors[r][0]))
    if first in errors:
        summary, text = errors[first][1], errors[first][2]
    else:
        summary = f"died with exit code {procs[first].exitcode}"
        text = f"({summary}, no traceback: killed or crashed)\n"
    also = "".join(f"rank {r} also failed: {errors[r][1] if r in errors else 'died'}\n"
                   for r in others)
    return RankError(f"rank {first} of {len(procs)} failed:\n{text}{also}", first, summary)


def spawn(fn: Callable[..., Any], world_size: int = 2, *args: Any,
          timeout: float = 300.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level function (picklable by reference).
        world_size: number of ranks (processes).
        *args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included; also the gloo timeout.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankError: a rank raised or died; names the rank and carries its traceback.
        TimeoutError: the ranks ran longer than ``timeout`` (they are killed).
    """
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    # before the server starts; embedtrain first, so FBGEMM binds as embedtrain/fbgemm_cpu.py says
    ctx.set_forkserver_preload(["embedtrain", "torch", "torchrec", __name__])
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="embedtrain-spawn-") as tmp:
        out = Path(tmp)
        port = free_port()
        deadline, finished_at = time.monotonic() + timeout, None
        procs = [ctx.Process(target=_run_rank, name=f"rank{rank}", daemon=True,
                             args=(fn, rank, world_size, port, tmp, (timeout, deadline), args,
                                   env))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            while True:
                if any((out / f"rank{r}.err").exists() or p.exitcode not in (None, 0)
                       for r, p in enumerate(procs)):
                    for p in procs:  # fail fast: the others may wait in a collective forever
                        p.join(timeout=1.0)
                    raise _failure(procs, out)
                if all(p.exitcode == 0 for p in procs):
                    break
                done = all((out / f"rank{r}.pt").exists() for r in range(world_size))
                if done and finished_at is None:
                    finished_at = time.monotonic()
                if done and time.monotonic() - finished_at > _TEARDOWN_GRACE_S:
                    # Every rank returned and wrote its result; only the group's teardown hangs.
                    stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
                    _log.warning(
                        "spawn(%s): rank(s) %s returned but did not exit within %.0f s; killed",
                        getattr(fn, "__name__", fn), stuck, _TEARDOWN_GRACE_S)
                    break
                if time.monotonic() > deadline:
                    stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
                    raise TimeoutError(f"spawn({getattr(fn, '__name__', fn)}): rank(s) {stuck} "
                                       f"still running after {timeout:.0f} s; killed"
                                       + _stacks(out, stuck))
                time.sleep(0.02)
            return [torch.load(out / f"rank{r}.pt", weights_only=False)
                    for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
