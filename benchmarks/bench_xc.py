"""Extreme-classification heads: training-step time at 1M classes (WIP: timing part only).

Each head trains on random features (batch ``--batch``, dim ``--dim``) with Zipfian labels over
``--classes`` classes, plain SGD on the head (sparse for Partial FC: only sampled rows move);
alternating rounds, medians of ``--steps`` steps after one warm-up step.

Usage:
    python benchmarks/bench_xc.py --classes 1000000 --dim 128 --json benchmarks/out/xc.json

Prints a table; JSON: ``step_ms`` per head and ``ratios``. The accuracy part (P@1 on
``embedtrain datagen xc`` data at equal examples seen) comes with the XC task.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from embedtrain.models.class_head import PartialFCHead, ShardedSoftmaxHead


def zipf_labels(n: int, classes: int, a: float, g: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, classes + 1, dtype=torch.float64)
    return torch.multinomial((ranks ** -a).float(), n, replacement=True, generator=g)


def make_heads(classes: int, dim: int, rate: float) -> dict:
    heads = {"full": ShardedSoftmaxHead(classes, dim),
             "partial_fc": PartialFCHead(classes, dim, sample_rate=rate)}
    cutoffs = [max(1, classes // 100), max(2, classes // 10)]
    heads["adaptive"] = torch.nn.AdaptiveLogSoftmaxWithLoss(dim, classes, cutoffs, div_value=4.0)
    return heads


def step(head, features, labels, lr: float = 0.1) -> None:
    if isinstance(head, torch.nn.AdaptiveLogSoftmaxWithLoss):
        loss = head(features, labels).loss
    else:
        loss = head(features, labels)
    loss.backward()
    with torch.no_grad():
        for p in head.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)  # sparse grads add only their rows
                p.grad = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    heads = make_heads(args.classes, args.dim, args.rate)
    labels = zipf_labels(args.batch, args.classes, 1.1, g)  # ids sorted by frequency
    times: dict[str, list[float]] = {name: [] for name in heads}
    for name, head in heads.items():  # warm-up
        step(head, torch.randn(args.batch, args.dim, generator=g), labels)
    for _ in range(args.rounds):
        for name, head in heads.items():
            for _ in range(args.steps):
                features = torch.randn(args.batch, args.dim, generator=g, requires_grad=True)
                start = time.perf_counter()
                step(head, features, labels)
                times[name].append((time.perf_counter() - start) * 1000)
    step_ms = {name: statistics.median(t) for name, t in times.items()}
    ratios = {f"full_vs_{name}": step_ms["full"] / step_ms[name] for name in step_ms if name != "full"}
    print(f"{args.classes:,} classes x {args.dim}, batch {args.batch}")
    for name, ms in step_ms.items():
        print(f"  {name:<12} {ms:9.1f} ms/step  ({step_ms['full'] / ms:5.1f}x vs full)")
    out = {"classes": args.classes, "dim": args.dim, "batch": args.batch, "rate": args.rate,
           "step_ms": step_ms, "ratios": ratios, "command": " ".join(sys.argv)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
