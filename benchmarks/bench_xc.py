"""Extreme-classification heads: training-step time at 1M classes, and P@1 at equal examples.

Part 1, step time (``--classes`` x ``--dim``, batch ``--batch``, one process, 2 intra-op threads).
Every head is built by :func:`embedtrain.heads.build.build_head` (what training builds) and stepped
as training steps it: forward, backward, then the optimizer step and ``zero_grad``:

- ``full`` (exact softmax), ``partial_fc`` (``--rate``), ``hard_negatives`` (10 nearest classes
  per example from an exact top-k over the index, index rebuilt every 100 steps, uniform sample
  ``--hn-sample-rate``), ``hard_negatives_clustered`` (the same from the clustered index, its
  default lists and probes): :func:`embedtrain.train.optim.sharded_head_optimizer` with the
  ``HeadConfig`` defaults (Adagrad, ``foreach=False``; the sampled heads' sparse gradients
  through the fused row update);
- ``adaptive`` (cutoffs from ``default_cutoffs``), ``mach`` (``--mach-buckets`` buckets, default
  ``build_head``'s ~sqrt(C); ``--mach-repetitions``): torch Adam (``dense_optimizer_factory`` of
  the ``OptimConfig`` defaults), as the dense optimizer steps them.

The sharded heads start from the same planted weights, as a trained head has them: class vectors
grouped around ``C / 500`` random topic directions (:func:`planted_vectors`; random isotropic
vectors have no neighbourhoods, and no approximate index finds their top-k). Features (with
``requires_grad``: an encoder's output, the backward computes their gradient too) are each
label's class direction plus as much Gaussian noise. Targets: Zipf(1.1) over the classes, class
id = frequency rank (fresh labels every step); the adaptive head's ``class_order`` is
``frequency_order`` of the counts of 10^6 labels drawn the same way. One warm-up step per head
(it builds the hard-negative indexes and Adam's state), then ``--rounds`` rounds, each running
``--steps`` steps of every head (the order reversed every other round); figures are medians over
all timed steps. A hard-negative step that rebuilds its index (1 step in ``refresh_every``) is
timed once more on its own and reported separately; the median excludes it. The clustered
index's recall@10 is measured at each build (``timing_index_recall``).

Part 2, accuracy at equal examples: a synthetic set (``embedtrain datagen xc``, ``--acc-classes``
classes, ``--acc-rows`` rows, ``--acc-vocab`` tokens) in ``--acc-data`` (reused when its
``metadata.json`` records the same generator settings), then one ``embedtrain train
configs/xc_synthetic.yaml`` subprocess per head, one at a time, all with the same settings
(batch 512, one epoch: every head sees the same examples in the same order; no periodic
evaluation, one checkpoint at the end, no progress bar) except ``head.kind`` (and, for
``hard_negatives``, ``head.sample_rate=--hn-sample-rate``, as in part 1). Test P@1, P@5,
nDCG@5, recall@5 and training examples/s come from each run's ``summary.json``, the Bayes-optimal
P@1 from the data set's metadata.

Usage:
    python benchmarks/bench_xc.py --classes 1000000 --dim 128 --json benchmarks/out/xc.json \
        [--steps 3] [--rounds 2] [--heads full,hard_negatives_clustered] [--skip-timing] \
        [--skip-accuracy] \
        [--acc-classes 20000] [--acc-rows 400000] [--acc-data /tmp/embedtrain_xc_acc]

Prints a table; JSON: ``step_ms`` (median per head), ``phase_ms`` (forward/backward/optimizer),
``round_step_ms``, ``ratios`` (``full_vs_<head>``), ``round_ratios``, ``refresh_step_ms``,
``timing_index_recall``, ``p_at_1`` (per head and ``oracle``), ``accuracy`` (every run's
figures, PSP@k and the clustered run's ``index_recall``), ``index_recall_at_10`` (the accuracy
run's, over the rebuilds of the trained head), the settings and ``command``.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from embedtrain.runtime import allocator_setting, tune_allocator

# as every embedtrain process, before torch's first allocation (EMBEDTRAIN_MALLOC=default: not)
tune_allocator()

import torch
from torch import Tensor, nn

from embedtrain.config import HeadConfig, HeadKind, NegativeIndex, OptimConfig, load_config
from embedtrain.heads.build import SHARDED_HEADS, build_head
from embedtrain.recipes.heads import head_arguments
from embedtrain.train.optim import dense_optimizer_factory, sharded_head_optimizer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/xc_synthetic.yaml"
# name -> (head kind, head settings beyond the kind)
HEADS: dict[str, tuple[HeadKind, dict[str, Any]]] = {
    "full": (HeadKind.FULL, {}),
    "partial_fc": (HeadKind.PARTIAL_FC, {}),
    "hard_negatives": (HeadKind.HARD_NEGATIVES, {}),
    "hard_negatives_clustered": (HeadKind.HARD_NEGATIVES, {"index": NegativeIndex.CLUSTERED}),
    "adaptive": (HeadKind.ADAPTIVE, {}),
    "mach": (HeadKind.MACH, {}),
}
ZIPF_A = 1.1
PHASES = ("forward", "backward", "optimizer")


def head_config(name: str, args: argparse.Namespace) -> HeadConfig:
    """The ``head`` section of head ``name`` as both parts use it (defaults otherwise)."""
    kind, settings = HEADS[name]
    cfg = HeadConfig(kind=kind, sample_rate=args.rate, mach_buckets=args.mach_buckets,
                     mach_repetitions=args.mach_repetitions, **settings)
    if kind is HeadKind.HARD_NEGATIVES:
        cfg.sample_rate = args.hn_sample_rate
    return cfg


def planted_vectors(classes: int, dim: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Class weights as a trained head has them: grouped around ``classes / 500`` topic
    directions (norm ~1), and each class's typical feature (its weight direction, scaled)."""
    topics = max(1, classes // 500)
    centres = torch.randn(topics, dim, generator=g)
    weight = (centres[torch.randint(0, topics, (classes,), generator=g)]
              + 0.5 * torch.randn(classes, dim, generator=g)) * dim ** -0.5
    return weight, weight * dim ** 0.5


def zipf_labels(n: int, classes: int, g: torch.Generator) -> Tensor:
    """``n`` class ids drawn from Zipf(1.1) over ``classes`` (id = frequency rank - 1)."""
    weights = torch.arange(1, classes + 1, dtype=torch.float64) ** -ZIPF_A
    return torch.multinomial(weights.float(), n, replacement=True, generator=g)


class TimedHead:
    """A head with its optimizer, stepped as training steps it, each phase timed."""

    def __init__(self, name: str, cfg: HeadConfig, classes: int, dim: int,
                 counts: Tensor, weight: Optional[Tensor] = None) -> None:
        self.name, kind = name, cfg.kind
        self.head = build_head(kind, classes, dim, **head_arguments(cfg), class_counts=counts,
                               seed=0)
        if weight is not None and kind in SHARDED_HEADS:
            with torch.no_grad():
                self.head.weight.copy_(weight)
        if kind in SHARDED_HEADS:
            self.optimizer = sharded_head_optimizer(self.head, cfg.optimizer, cfg.lr)
        else:
            o = OptimConfig()
            factory = dense_optimizer_factory(o.dense, o.dense_lr, o.weight_decay, o.momentum)
            self.optimizer = factory(list(self.head.parameters()))

    def step(self, features: Tensor, labels: Tensor) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = self.head(features, labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        return {"forward": (t1 - t0) * 1e3, "backward": (t2 - t1) * 1e3,
                "optimizer": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3}


def describe(head: nn.Module) -> dict[str, Any]:
    """The settings a head was built with that the table does not show."""
    out: dict[str, Any] = {"class": type(head).__name__,
                           "parameters": sum(p.numel() for p in head.parameters())}
    for name in ("sample_rate", "negatives", "refresh_every", "num_buckets", "num_repetitions",
                 "loss", "index_kind", "index_clusters", "index_probe"):
        if hasattr(head, name):
            value = getattr(head, name)
            out[name] = value.value if isinstance(value, enum.Enum) else value
    if hasattr(head, "cutoffs"):
        out["cutoffs"] = head.cutoffs
    return out


def time_heads(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: median training-step time of every head, side by side."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    c, d, b = args.classes, args.dim, args.batch
    counts = torch.bincount(zipf_labels(1_000_000, c, g), minlength=c)
    weight, typical = planted_vectors(c, d, g)
    heads = {}
    for name in args.heads:
        print(f"building {name} ({c:,} x {d})", flush=True)
        heads[name] = TimedHead(name, head_config(name, args), c, d, counts, weight)
    del weight
    # Every head gets the same sequence of batches (its own i-th step, the i-th batch).
    steps = args.rounds * args.steps + 3
    labels = zipf_labels(steps * b, c, g).view(steps, b)
    noise = torch.randn(steps, b, d, generator=g)
    taken = {name: 0 for name in heads}

    def run(timed: TimedHead) -> dict[str, float]:
        i = taken[timed.name]
        taken[timed.name] += 1
        # An encoder's output: near the label's class direction, with noise of the same size.
        features = (typical[labels[i]] + noise[i]).requires_grad_()
        return timed.step(features, labels[i])

    load_before = os.getloadavg()[0]
    for name, timed in heads.items():
        warm = run(timed)
        print(f"warm-up {name}: {warm['total']:.0f} ms", flush=True)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in heads}
    rounds: dict[str, list[float]] = {name: [] for name in heads}
    for r in range(args.rounds):
        order = list(heads) if r % 2 == 0 else list(reversed(heads))
        for name in order:
            times = [run(heads[name]) for _ in range(args.steps)]
            samples[name] += times
            rounds[name].append(statistics.median(t["total"] for t in times))
            print(f"round {r + 1} {name}: " + ", ".join(f"{t['total']:.0f}" for t in times)
                  + " ms", flush=True)
    refresh_ms = {}
    for name in (n for n in ("hard_negatives", "hard_negatives_clustered") if n in heads):
        hn = heads[name].head
        hn.steps.fill_((int(hn.steps) // hn.refresh_every + 1) * hn.refresh_every)  # a rebuild
        refresh_ms[name] = run(heads[name])["total"]
    recall = (heads["hard_negatives_clustered"].head.index_recall
              if "hard_negatives_clustered" in heads else [])
    step_ms = {n: statistics.median(t["total"] for t in s) for n, s in samples.items()}
    phase_ms = {n: {p: statistics.median(t[p] for t in s) for p in PHASES}
                for n, s in samples.items()}
    full = "full"
    ratios = {f"full_vs_{n}": step_ms[full] / ms for n, ms in step_ms.items() if n != full}
    round_ratios = {f"full_vs_{n}": [f / x for f, x in zip(rounds[full], rounds[n])]
                    for n in heads if n != full}
    return {
        "step_ms": step_ms,
        "phase_ms": phase_ms,
        "round_step_ms": rounds,
        "ratios": ratios,
        "round_ratios": round_ratios,
        "refresh_step_ms": refresh_ms,
        # the median step with its index's rebuild spread over the refresh_every steps
        "amortized_step_ms": {n: step_ms[n] + (ms - step_ms[n]) / heads[n].head.refresh_every
                              for n, ms in refresh_ms.items()},
        # per rebuild: recall@10 of the clustered index on 256 of the step's examples
        "timing_index_recall": recall,
        "heads": {n: describe(t.head) for n, t in heads.items()},
        "timing_load_avg_1m": [load_before, os.getloadavg()[0]],
    }


def ensure_data(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The accuracy data set: reused when its generator settings match, else generated."""
    path = Path(args.acc_data)
    want = {"classes": args.acc_classes, "rows": args.acc_rows, "vocab": args.acc_vocab,
            "seed": 0, "multi_label": False}
    meta_file = path / "metadata.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        generator = meta.get("generator", {})
        if all(generator.get(k) == v for k, v in want.items()):
            print(f"reusing {path}", flush=True)
            return path, meta
        raise SystemExit(f"{meta_file}: generated with other settings "
                         f"({ {k: generator.get(k) for k in want} }); pass another --acc-data")
    cmd = [sys.executable, "-m", "embedtrain", "datagen", "xc", "--classes", str(args.acc_classes),
           "--rows", str(args.acc_rows), "--vocab", str(args.acc_vocab), "--out", str(path)]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return path, json.loads(meta_file.read_text())


def train_head(name: str, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """One epoch of ``configs/xc_synthetic.yaml`` with head ``name``; its test figures."""
    out = Path(args.acc_out) / name
    cfg = head_config(name, args)
    sets = [f"data.path={data}", "data.batch_size=512", "train.epochs=1", "train.eval_every=0",
            "train.checkpoint_every=0", "train.progress=false", f"head.kind={cfg.kind.value}",
            f"head.sample_rate={cfg.sample_rate}", f"head.index={cfg.index.value}"]
    if args.mach_buckets:
        sets.append(f"head.mach_buckets={args.mach_buckets}")
    sets.append(f"head.mach_repetitions={args.mach_repetitions}")
    cmd = [sys.executable, "-m", "embedtrain", "train", CONFIG, "--out", str(out), "--overwrite",
           "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    print("$ " + " ".join(cmd), flush=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    record: dict[str, Any] = {"wall_s": time.perf_counter() - start, "command": " ".join(cmd),
                              "load_avg_1m": [load_before, os.getloadavg()[0]]}
    summary_file = out / "summary.json"
    if proc.returncode or not summary_file.is_file():
        record["error"] = f"exit status {proc.returncode}"
        record["stderr_tail"] = proc.stderr[-4000:]
        print(record["stderr_tail"], file=sys.stderr)
        return record
    summary = json.loads(summary_file.read_text())
    keys = ("p@1", "p@5", "ndcg@5", "recall@5", "psp@1", "psp@5", "loss",
            "train_examples_per_s", "examples", "steps", "train_time_s", "wall_time_s",
            "oracle_p_at_1", "index_recall")
    # Not peak_rss_gb_per_rank: ru_maxrss starts at this (large) process's high-water mark.
    record.update({k: summary.get(k) for k in keys})
    print(f"  {name}: P@1 {record['p@1']:.4f}, {record['train_examples_per_s']:,.0f} ex/s, "
          f"wall {record['wall_s']:.0f} s", flush=True)
    return record


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: every head trained on the same examples; test P@1 against the oracle's."""
    data, meta = ensure_data(args)
    runs = {name: train_head(name, args, data) for name in HEADS}
    oracle = meta["oracle_p_at_1"]["test"]
    dim = load_config(ROOT / CONFIG).xc.mlp[-1]
    with torch.device("meta"):  # the heads' settings at this size (no memory)
        heads = {name: describe(build_head(cfg.kind, args.acc_classes, dim,
                                           **head_arguments(cfg)))
                 for name, cfg in ((n, head_config(n, args)) for n in HEADS)}
    p_at_1: dict[str, Any] = {n: r.get("p@1") for n, r in runs.items()}
    p_at_1["oracle"] = oracle
    recalls = [r["recall"] for r in runs["hard_negatives_clustered"].get("index_recall") or []]
    return {"p_at_1": p_at_1, "accuracy": runs, "acc_heads": heads, "acc_data": str(data),
            "acc_splits": {s: v["rows"] for s, v in meta["splits"].items()},
            # the clustered index's recall@10 over the run's rebuilds of a trained head (all
            # but the first, which indexes the random initial weights: no structure to find)
            "index_recall_at_10": statistics.mean(recalls[1:]) if recalls[1:] else None,
            "index_recall_at_10_min": min(recalls[1:]) if recalls[1:] else None,
            "index_recall_at_10_initial": recalls[0] if recalls else None}


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(out: dict[str, Any]) -> None:
    if "step_ms" in out:
        step, phase = out["step_ms"], out["phase_ms"]
        print(f"\nstep time: {out['classes']:,} classes x {out['dim']}, batch {out['batch']}, "
              f"median of {out['rounds']} x {out['steps']} steps")
        print("| head | ms/step | forward | backward | optimizer | full / head | per round |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for n, ms in step.items():
            p = phase[n]
            rounds = out["round_ratios"].get(f"full_vs_{n}", [])
            print(f"| {n} | {ms:,.0f} | {p['forward']:,.0f} | {p['backward']:,.0f} | "
                  f"{p['optimizer']:,.0f} | {step['full'] / ms:.1f}x | "
                  f"{', '.join(f'{r:.1f}' for r in rounds) or '-'} |")
        for n, ms in out["refresh_step_ms"].items():
            amortized = out["amortized_step_ms"][n]
            print(f"{n} step with an index rebuild: {ms:,.0f} ms; amortized step {amortized:,.0f}"
                  f" ms ({step['full'] / amortized:.1f}x faster than full)")
        recall = out["timing_index_recall"]
        if recall:
            print("clustered index recall@10 (planted vectors): "
                  + ", ".join(f"step {r['step']}: {r['recall']:.3f}" for r in recall)
                  + f" ({recall[0]['clusters']} clusters, {recall[0]['probe']} probed)")
    if "accuracy" in out:
        splits = out["acc_splits"]
        print(f"\naccuracy: {out['acc_classes']:,} classes, {splits['train']:,} training rows "
              f"(one epoch, batch 512), test {splits['test']:,} rows; "
              f"oracle P@1 {out['p_at_1']['oracle']:.4f}")
        print("| head | P@1 | P@5 | nDCG@5 | recall@5 | PSP@5 | train ex/s | run wall s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for n, r in out["accuracy"].items():
            print(f"| {n} | {fmt(r.get('p@1'), '.4f')} | {fmt(r.get('p@5'), '.4f')} | "
                  f"{fmt(r.get('ndcg@5'), '.4f')} | {fmt(r.get('recall@5'), '.4f')} | "
                  f"{fmt(r.get('psp@5'), '.4f')} | "
                  f"{fmt(r.get('train_examples_per_s'), ',.0f')} | {r['wall_s']:.0f} |")
        print(f"clustered index recall@10 over the run's rebuilds after the first: mean "
              f"{fmt(out['index_recall_at_10'], '.4f')}, min "
              f"{fmt(out['index_recall_at_10_min'], '.4f')}; first (random initial weights): "
              f"{fmt(out['index_recall_at_10_initial'], '.4f')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="output JSON file")
    parser.add_argument("--classes", type=int, default=1_000_000, help="classes (step time)")
    parser.add_argument("--dim", type=int, default=128, help="feature dimension (step time)")
    parser.add_argument("--batch", type=int, default=512, help="batch size (step time)")
    parser.add_argument("--rate", type=float, default=0.1, help="partial_fc sample rate")
    parser.add_argument("--hn-sample-rate", type=float, default=0.0,
                        help="hard_negatives' extra uniform sample rate (both parts)")
    parser.add_argument("--mach-buckets", type=int, default=0,
                        help="MACH buckets (0: build_head's default, about sqrt(C))")
    parser.add_argument("--mach-repetitions", type=int, default=4, help="MACH repetitions R")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per head and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds alternating the heads")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--acc-classes", type=int, default=20_000)
    parser.add_argument("--acc-rows", type=int, default=400_000)
    parser.add_argument("--acc-vocab", type=int, default=200_000)
    parser.add_argument("--acc-data", default="/tmp/embedtrain_xc_acc")
    parser.add_argument("--acc-out", default="/tmp/embedtrain_xc_acc_runs",
                        help="run directories of the accuracy part")
    parser.add_argument("--heads", default=",".join(HEADS),
                        help="comma-separated heads to time (full is always timed: the ratios "
                             "are against it)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    chosen = set(args.heads.split(",")) | {"full"}
    if chosen - set(HEADS):
        parser.error(f"--heads: unknown {sorted(chosen - set(HEADS))}; known: {', '.join(HEADS)}")
    args.heads = [n for n in HEADS if n in chosen]
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "allocator": allocator_setting(),
        "classes": args.classes, "dim": args.dim, "batch": args.batch, "rate": args.rate,
        "hn_sample_rate": args.hn_sample_rate, "mach_repetitions": args.mach_repetitions,
        "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        "acc_classes": args.acc_classes, "acc_rows": args.acc_rows, "acc_vocab": args.acc_vocab,
        "torch": torch.__version__, "cores": os.cpu_count(),
    }
    if not args.skip_timing:
        out.update(time_heads(args))
        if "mach" in out["heads"]:
            out["mach_buckets"] = out["heads"]["mach"]["num_buckets"]
    if not args.skip_accuracy:
        out.update(accuracy(args))
    out["command"] = " ".join(["python", *sys.argv])
    print_tables(out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
