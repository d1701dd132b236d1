"""Training throughput: embedtrain's Trainer vs a minimal hand-written TorchRec loop, side by side.

Both train the same DLRM (the demo config's sizes) with fused row-wise Adagrad and Adam on the same
data set, in one process, alternating rounds so machine noise hits both alike. Three rows:
- hand-written: DMP forward/backward/step over pre-built batches (the anchor's loop);
- trainer step: ``Trainer._train_step`` over the same pre-built batches (loop overhead only);
- trainer + reader: ``Trainer`` reading parquet through ``ParquetBatchReader`` (what a run sees:
  ``data.num_workers`` as configured, ``auto`` by default; the epochs follow one another across
  rounds, so an epoch's start is paid once an epoch, as in a run).
Every loop runs once before the rounds (the reader's first one fills its shuffle buffer).

Then, with a second model in the process, rounds of the hand-written loop and the trainer +
reader under ``train.pipeline: sparse_dist`` (TorchRec's ``TrainPipelineSparseDist``, a second
run of the same config), the ratio over that phase's hand-written loop. On one CPU process there
is no all-to-all to hide and no copy stream: expect no gain, only its overhead. The second model
is built after the first rows' rounds, so that those run with one model in the process, as a
run does.

Usage: python benchmarks/bench_train_loop.py [--data data/synthetic_ctr] [--steps 30] [--rounds 5]
    [--json benchmarks/out/train_loop.json] [--set data.num_workers=1 ...]
Prints a table and writes the JSON (``rows[name].ratio``: the row's median examples/s over the
hand-written loop's; ``rows[name].paired_ratio``: the median over rounds of the row's examples/s
over the hand-written loop's in the same round, which cancels most of this shared machine's drift
between rounds; ``rows[name].all``: every round; ``rows[name].minor_faults_per_step``: minor
page faults of the process a step, the median over rounds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import resource
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

from embedtrain.runtime import tune_allocator

# as every embedtrain process, before torch's first allocation (EMBEDTRAIN_MALLOC=default: not)
tune_allocator()

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from embedtrain.config import load_config  # noqa: E402
from embedtrain.recipes import build_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/synthetic_ctr")
    parser.add_argument("--config", default="configs/dlrm_synthetic.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", "--out", dest="out", default="benchmarks/out/train_loop.json",
                        help="where to write the results")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for every row (repeatable)")
    args = parser.parse_args()

    cfg = load_config(args.config, [f"data.path={args.data}", *args.overrides])
    run = build_run(cfg, "/tmp/embedtrain_bench_run", progress=False)
    trainer, model, optimizer = run.trainer, run.trainer.model, run.trainer.optimizer
    batch_size = cfg.data.batch_size
    it = trainer.train_data.iter_epoch(0)
    batches = [next(it) for _ in range(args.steps)]

    def hand_written() -> float:
        start = time.perf_counter()
        for b in batches:
            loss = F.binary_cross_entropy_with_logits(
                model(b.dense_features, b.sparse_features).squeeze(-1), b.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return len(batches) * batch_size / (time.perf_counter() - start)

    def trainer_step() -> float:
        start = time.perf_counter()
        for b in batches:
            trainer._train_step(b)
        return len(batches) * batch_size / (time.perf_counter() - start)

    # The reader's epochs follow one another across rounds, as in a run: an epoch's start (the
    # shuffle buffer's first fill) is paid once an epoch, not once a round.
    read = itertools.chain.from_iterable(trainer.train_data.iter_epoch(e)
                                         for e in itertools.count(1))

    def trainer_reader() -> float:
        start = time.perf_counter()
        for b in itertools.islice(read, len(batches)):
            trainer._train_step(b)
        return len(batches) * batch_size / (time.perf_counter() - start)

    # warm-up, every loop once (the reader fills its first shuffle buffer)
    hand_written(); trainer_step(); trainer_reader()
    loops = {"hand-written DMP loop": hand_written, "Trainer step": trainer_step,
             "Trainer + ParquetBatchReader": trainer_reader}
    rows = _rounds(loops, args.rounds, args.steps)

    # The pipeline's trainer is a second model: built only now, so that the rows above run with
    # one model in the process, as a run does (built first and run in the same rounds, its
    # presence alone cost the reader's row ~3%: paired 0.919-0.930 against 0.962 without it).
    piped = build_run(load_config(args.config, [f"data.path={args.data}", *args.overrides,
                                                "train.pipeline=sparse_dist"]),
                      "/tmp/embedtrain_bench_run_piped", progress=False).trainer
    piped_epoch = [1]

    def trainer_pipelined() -> float:
        start = time.perf_counter()
        n = 0
        batches_iter = piped.train_data.iter_epoch(piped_epoch[0])
        while n < len(batches) and piped._step(batches_iter):
            n += 1
        piped.pipelined.reset()
        batches_iter.close()
        piped_epoch[0] += 1
        return n * batch_size / (time.perf_counter() - start)

    trainer_pipelined()  # warm-up (the pipeline traces once)
    piped_rows = _rounds({"hand-written DMP loop (with the pipeline's model)": hand_written,
                          "Trainer + reader, pipeline sparse_dist": trainer_pipelined},
                         args.rounds, args.steps)

    result = {"batch_size": batch_size, "steps_per_round": args.steps, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "data": args.data,
              "loader_threads": trainer.train_data.num_workers, "rows": {}}
    print(f"torch threads {torch.get_num_threads()}, loader threads "
          f"{trainer.train_data.num_workers} (data.num_workers: "
          f"{'auto' if cfg.data.num_workers is None else cfg.data.num_workers})")
    print(f"{'loop':<52} {'median ex/s':>12} {'vs hand-written':>16} {'paired':>8} "
          f"{'faults/step':>12}")
    for group in (rows, piped_rows):
        hand = group[next(iter(group))]["examples_per_s"]
        base = statistics.median(hand)
        for name, row in group.items():
            values = row["examples_per_s"]
            med = statistics.median(values)
            paired = statistics.median(v / h for v, h in zip(values, hand))
            faults = statistics.median(row["minor_faults_per_step"])
            result["rows"][name] = {"median_examples_per_s": med, "all": values,
                                    "ratio": med / base, "paired_ratio": paired,
                                    "minor_faults_per_step": faults}
            print(f"{name:<52} {med:>12,.0f} {med / base:>15.3f}x {paired:>7.3f}x "
                  f"{faults:>12,.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _rounds(loops: dict[str, Callable[[], float]], rounds: int,
            steps: int) -> dict[str, dict[str, list]]:
    """Runs the loops one after the other, ``rounds`` times; each round printed against the
    first loop. Returns each loop's examples/s and minor page faults a step, per round."""
    out: dict[str, dict[str, list]] = {
        name: {"examples_per_s": [], "minor_faults_per_step": []} for name in loops}
    first = next(iter(loops))
    for r in range(rounds):
        for name, loop in loops.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out[name]["examples_per_s"].append(loop())
            out[name]["minor_faults_per_step"].append(
                (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps)
        hand = out[first]["examples_per_s"][-1]
        print(f"round {r + 1}: " + ", ".join(
            f"{name} {row['examples_per_s'][-1]:,.0f} ex/s ({row['examples_per_s'][-1] / hand:.3f})"
            for name, row in out.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
