"""Planner memory estimate vs what two gloo ranks actually hold after sharding.

Plans a training config on a CPU cluster file (default: the demo DLRM on ``cpu-1x2``), then
spawns the cluster's ranks (gloo, 127.0.0.1), shards the model with TorchRec's
``DistributedModelParallel`` *using that plan* and embedtrain's sharders, runs ``--steps``
training steps on the data set so that every optimizer state exists, and measures per rank:

* embedding weights: the local shards of every table in the model's ``state_dict``
  (``ShardedTensor`` local shards; data-parallel tables count in full on every rank);
* embedding optimizer state: the local shards of the fused optimizer's ``state_dict``, plus the
  state of the in-backward optimizers of data-parallel tables.

and compares them with the plan's per-rank ``embedding_params + embedding_optimizer``.

Usage:
    python benchmarks/bench_plan_memory.py --json benchmarks/out/plan_memory.json \
        [--config configs/dlrm_synthetic.yaml] [--cluster configs/clusters/cpu-1x2.yaml]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from embedtrain.config import load_cluster, load_config
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta
    from embedtrain.sharding.measure import measure_embedding_bytes
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.recipes.ctr import CTRRecipe

    cfg, cluster = load_config(args.config, args.overrides), load_cluster(args.cluster)
    torch.manual_seed(0)
    recipe = CTRRecipe(cfg)
    plan = recipe.plan(cluster)  # every rank plans; the search is deterministic
    meta = load_dataset_meta(cfg.data.path)
    model = recipe.planning_model()  # on meta, sparse optimizer fused
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan.sharding_plan,
                                   sharders=embedding_sharders(cfg.sharding.forward_comm_precision,
                                                               cfg.sharding.backward_comm_precision),
                                   env=ShardingEnv.from_process_group(dist.GroupMember.WORLD))
    reader = ParquetBatchReader(meta.files("train"), meta.features,
                                batch_size=cluster.batch_size_per_rank, rank=rank,
                                world_size=world, num_workers=0)
    # Dense parameters, data-parallel tables included (no fused optimizer on them), as in training.
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters(), include=False))
    opt = torch.optim.Adam(list(dense.values()), lr=1e-3)
    for step, batch in enumerate(reader.iter_epoch(0)):
        if step >= args.steps:
            break
        logits = dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        loss.backward()
        opt.step()
        opt.zero_grad()

    held = measure_embedding_bytes(dmp)
    replicated = [n for n, p in dmp.named_parameters()
                  if any(f".{t.name}." in n for t in plan.report.tables
                         if t.sharding_type == "data_parallel")]
    state = opt.state_dict()["state"]
    # Data-parallel tables are stepped by the dense optimizer: count its state for them.
    dp_state = sum(v.numel() * v.element_size() for i, n in enumerate(dense) if n in replicated
                   for v in state.get(i, {}).values() if isinstance(v, torch.Tensor) and v.dim())
    estimate = plan.report.ranks[rank].memory[plan.report.memory_tier]
    result = {"rank": rank, "measured_weights": held["weights"],
              "measured_optimizer": held["optimizer"] + dp_state,
              "estimated_weights": estimate.get("embedding_params"),
              "estimated_optimizer": estimate.get("embedding_optimizer"),
              "sharding_types": plan.report.summary.sharding_types}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs/dlrm_synthetic.yaml"))
    parser.add_argument("--cluster", default=str(ROOT / "configs/clusters/cpu-1x2.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from embedtrain.config import load_cluster
    from embedtrain.processes import free_port

    world = load_cluster(args.cluster).world_size
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, free_port(), args, out), nprocs=world)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    print(f"{'rank':>4} {'measured MiB':>13} {'estimated MiB':>14} {'ratio':>6}")
    for r in ranks:
        r["measured"] = r["measured_weights"] + r["measured_optimizer"]
        r["estimated"] = r["estimated_weights"] + r["estimated_optimizer"]
        r["ratio"] = r["estimated"] / r["measured"]
        print(f"{r['rank']:>4} {r['measured'] / 2**20:13.2f} {r['estimated'] / 2**20:14.2f} "
              f"{r['ratio']:6.3f}")
    worst = max(abs(r["ratio"] - 1) for r in ranks)
    print(f"sharding: {ranks[0]['sharding_types']}; largest deviation {worst:.2%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"ranks": ranks, "max_abs_deviation": worst,
                                           "command": " ".join(sys.argv)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
