"""Process-group setup: one process per device, launched by ``torchrun`` or alone.

Training always runs under ``torch.distributed`` (a world of one when launched plainly), so the
same ``DistributedModelParallel`` code path serves a laptop and a cluster.

The teardown is in :mod:`embedtrain.processes`: ``destroy_process_group``, and ``exit_process``,
through which a process that joined a group leaves (that module says why).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from embedtrain.processes import mark_joined


def init_process_group() -> tuple[int, int, torch.device]:
    """Joins (or creates) the default process group; gloo on CPU, nccl on CUDA.

    Returns:
        ``(rank, world_size, device)`` of this process.
    """
    mark_joined()
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

