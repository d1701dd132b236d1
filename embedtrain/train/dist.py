"""Process-group setup and teardown: one process per device, launched by ``torchrun`` or alone.

Training always runs under ``torch.distributed`` (a world of one when launched plainly), so the
same ``DistributedModelParallel`` code path serves a laptop and a cluster.

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
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


_joined = False  # whether this process ever joined a process group (gloo threads may live on)


def joined_process_group() -> bool:
    """Whether :func:`init_process_group` ran in this process (its threads may still run)."""
    return _joined


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group() -> tuple[int, int, torch.device]:
    """Joins (or creates) the default process group; gloo on CPU, nccl on CUDA.

    Returns:
        ``(rank, world_size, device)`` of this process.
    """
    global _joined
    _joined = True
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:  # launched by torchrun: rendezvous through its env variables
            from torch.distributed.rendezvous import rendezvous

            store, rank, world = next(rendezvous("env://"))
            # torchrun keeps its store across restarts: without a key prefix per attempt, gloo
            # of a restarted job can read the dead workers' addresses and fail to connect.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"embedtrain/attempt_{attempt}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
        else:  # launched plainly: a world of one, with an in-memory store (no port, no env)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return rank, world, device


def destroy_process_group(barrier: bool = False) -> None:
    """Leaves the default process group (and every group made from it), if this process joined.

    Args:
        barrier: wait for the other ranks first (only on success: a failed peer never arrives).
    """
    if not dist.is_initialized():
        return
    if barrier and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int, barrier: bool = False) -> NoReturn:
    """Ends a process that may have used ``torch.distributed``: see the module docstring.

    Destroys the process group (after a barrier when ``barrier``), flushes logging, stdout and
    stderr, then exits with ``code`` without running interpreter finalization. Only for the
    outermost entry points (the CLI, spawned test ranks), never inside a library call.
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
