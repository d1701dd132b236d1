"""``embedtrain plan``: the dry-run plan of a config on a cluster file, a sweep over clusters and
host counts, or ``--calibrate`` (this machine's rates written into a cluster file)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from embedtrain.cli.errors import UsageError
from embedtrain.config import MAX_RANKS, load_cluster, load_config

MAX_SWEEP = 256  # host counts one --hosts sweep plans


def register(sub) -> None:
    """Adds the ``plan`` command to the subparsers ``sub``."""
    p = sub.add_parser("plan", help="dry-run sharding plan of a config on a target cluster")
    p.add_argument("config", nargs="?", help="training config, YAML (see configs/); not with "
                   "--calibrate")
    p.add_argument("--cluster", required=True, action="append",
                   help="cluster description, YAML (configs/clusters/); repeat it to compare "
                        "clusters (a sweep: one table, sweep.html)")
    p.add_argument("--hosts", help="sweep host counts of each cluster file: N, A..B or A,B,C "
                                   "(e.g. 1..16)")
    p.add_argument("--out", help="report directory (default: plans/<config>-<cluster>)")
    p.add_argument("--format", default="md,json,html",
                   help="comma-separated report formats: md, json, html (default: all three)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sharding.forward_comm_precision=fp16")
    p.add_argument("--budget", type=int, help="partitions the local search may try "
                   "(default: sharding.search_budget)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (a cpu cluster file's ranks, gloo): lookup and "
                        "collective bandwidths and the fixed cost per sharding type, and write "
                        "the cluster file (to --out, default: the --cluster file itself)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if not args.config:
        raise UsageError("plan: give a training config (or --calibrate)")
    if args.hosts:
        _host_counts(args.hosts)  # a bad sweep is refused before the config loads the stack
    cfg = load_config(args.config, args.overrides)
    if len(args.cluster) > 1 or args.hosts:
        if args.budget is not None:
            cfg.sharding.search_budget = args.budget
        return _sweep(args, cfg)
    cluster = load_cluster(args.cluster[0])
    from embedtrain.sharding.report import FORMATS, write_report

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:  # checked before planning, which can take a while
        raise UsageError(f"--format: unknown {', '.join(unknown) or '(empty)'} "
                         f"(use {', '.join(FORMATS)})")
    if args.budget is not None:
        cfg.sharding.search_budget = args.budget
    out = Path(args.out) if args.out else Path("plans") / f"{Path(args.config).stem}-{cluster.name}"
    from embedtrain.recipes import plan_model

    result = plan_model(cfg, cluster)
    report = result.report
    report.model = {**(report.model or {}), "config": str(args.config)}
    paths = write_report(report, out, formats)
    s = report.summary
    print(f"plan of {args.config} on {cluster.name} ({cluster.world_size} ranks, "
          f"{cluster.device.value}): {s.tables} tables, "
          f"{(s.embedding_weight_bytes + s.embedding_optimizer_bytes) / 2**30:.2f} GiB "
          f"of weights and optimizer state")
    for w in report.warnings:
        print(f"  warning: {w}")
    print(f"  sharding: {', '.join(f'{k} x{v}' for k, v in s.sharding_types.items())}")
    print(f"  slowest rank {s.embedding_max_rank_ms:.3f} ms of embedding work per step "
          f"(mean {s.embedding_mean_rank_ms:.3f}, imbalance {s.imbalance:.2f}); "
          f"dense all-reduce {s.dense_allreduce_ms:.3f} ms")
    print(f"  peak {s.memory_tier.value.upper()} per rank "
          f"{s.peak_rank_memory_bytes / 2**30:.2f} of {s.rank_memory_capacity_bytes / 2**30:.2f} GiB")
    print(f"  planned in {report.planner.seconds:.2f} s ({report.planner.partitions} partitions)")
    print(f"report: {', '.join(str(p) for p in paths)}")
    return 0


def _host_counts(text: str) -> list[int]:
    """``--hosts``: ``N``, ``A..B`` or ``A,B,C``; sized before any list is made of a range."""
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split(".."))
            if low > high:
                raise UsageError(f"--hosts {text}: A..B needs A <= B (a range of host counts, "
                                 f"e.g. {high}..{low})")
            counts: Sequence[int] = range(low, high + 1)
            lowest, highest = low, high
        else:
            counts = [int(x) for x in text.split(",")]
            lowest, highest = min(counts), max(counts)
    except ValueError:
        counts, lowest, highest = [], 0, 0
    if not counts or lowest < 1:
        raise UsageError(f"--hosts: expected N, A..B or A,B,C of positive integers, got {text!r}")
    if len(counts) > MAX_SWEEP or highest > MAX_RANKS:
        raise UsageError(f"--hosts {text}: at most {MAX_SWEEP} host counts of at most "
                         f"{MAX_RANKS:,} each, got {len(counts):,} up to {highest:,}")
    return list(counts)


def _sweep(args: argparse.Namespace, cfg) -> int:
    """``embedtrain plan CONFIG --cluster A --cluster B [--hosts 1..16]``: every candidate
    planned; one table (stdout, ``sweep.json``, ``sweep.html``); exit 0 when one fits."""
    import dataclasses

    from embedtrain.recipes import plan_model
    from embedtrain.sharding.planner import PlanError

    candidates = []
    for path in args.cluster:
        base = load_cluster(path)
        for hosts in (_host_counts(args.hosts) if args.hosts else [base.hosts]):
            if hosts * base.devices_per_host > MAX_RANKS:
                raise UsageError(f"--hosts {hosts}: {hosts * base.devices_per_host:,} ranks with "
                                 f"{path}'s {base.devices_per_host} a host: more than "
                                 f"embedtrain plans for ({MAX_RANKS:,})")
            candidates.append(dataclasses.replace(
                base, hosts=hosts, name=f"{base.name}@{hosts}x{base.devices_per_host}"
                if args.hosts else base.name))
    rows = []
    for cluster in candidates:
        row = {"cluster": cluster.name, "ranks": cluster.world_size, "hosts": cluster.hosts,
               "device": cluster.device.value}
        try:
            s = plan_model(cfg, cluster).report.summary
            row.update(fits=True, peak_rank_gib=s.peak_rank_memory_bytes / 2**30,
                       capacity_gib=s.rank_memory_capacity_bytes / 2**30,
                       step_estimate_ms=s.step_estimate_ms, imbalance=s.imbalance)
        except PlanError as e:
            if not str(e).startswith("does not fit"):
                raise  # a constraint error is the config's, not the cluster's: one line, exit 2
            row.update(fits=False, why=str(e))
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    smallest = min(fitting, key=lambda r: (r["ranks"], r["step_estimate_ms"])) if fitting else None
    out = Path(args.out) if args.out else Path("plans") / f"{Path(args.config).stem}-sweep"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(
        {"config": str(args.config), "candidates": rows,
         "smallest_that_fits": smallest["cluster"] if smallest else None}, indent=2) + "\n")
    head = ["cluster", "ranks", "fits", "peak GiB / rank", "step estimate ms"]
    lines = []
    for r in rows:
        mark = " <- smallest that fits" if r is smallest else ""
        cells = [r["cluster"], str(r["ranks"]), "yes" if r["fits"] else "no",
                 f"{r['peak_rank_gib']:.2f} of {r['capacity_gib']:.2f}" if r["fits"] else "-",
                 f"{r['step_estimate_ms']:.3f}" if r["fits"] else r["why"][:60]]
        lines.append((cells, mark))
    widths = [max(len(h), *(len(c[i]) for c, _ in lines)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for cells, mark in lines:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + mark)
    from embedtrain.sharding.report import render_sweep_html

    best = next((n for n, (_, mark) in enumerate(lines) if mark), None)
    (out / "sweep.html").write_text(render_sweep_html(str(args.config), head,
                                                      [c for c, _ in lines], best))
    print(f"smallest that fits: {smallest['cluster'] if smallest else 'none'}; "
          f"report: {out / 'sweep.html'}, {out / 'sweep.json'}")
    return 0 if smallest else 1


def _calibrate(args: argparse.Namespace) -> int:
    """``embedtrain plan --calibrate --cluster FILE [--out FILE]``."""
    if args.config or len(args.cluster) != 1 or args.hosts:
        raise UsageError("--calibrate: give one --cluster file and no config or --hosts")
    from embedtrain.sharding.calibrate import calibrate
    from embedtrain.sharding.calibrate_file import write_cluster_yaml

    path = args.cluster[0]
    calibration = calibrate(load_cluster(path))
    out = args.out or path
    try:
        write_cluster_yaml(calibration, out, template=path)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write the cluster file ({e.strerror or e})")
    for line in calibration.header():
        print(line)
    print(f"wrote {out}")
    return 0
