"""Ingestion throughput and peak memory: raw synthetic Criteo TSV -> ``embedtrain ingest``.

Generates (or reuses) ``--rows`` rows of the synthetic data set as raw TSV under ``OUT/raw``, then
runs ``embedtrain ingest configs/ingest/criteo_synthetic.yaml`` on it in a child process, writing
``OUT/ingested``. The child's memory is read from ``/proc/<pid>/status`` every 0.1 s (resident
total, anonymous and file-backed, to tell the job's own memory from mapped input pages), and its
exact peak resident set comes from ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` when it ends.

Acceptance target (the pipelines issue): ingesting a raw TSV larger than 2 GB holds peak RSS under
4 GB. At ~296 bytes per row, ``--rows 7500000`` gives ~2.2 GB.

Usage:
    python benchmarks/bench_ingest.py --rows 7500000 --out /tmp/bench_ingest \\
        --json benchmarks/out/ingest.json [--cleanup]

``--engine ray`` runs the same spec on ``--files`` input files with both engines, one after the
other (``embedtrain ingest --engine ray --num-cpus N``, a local Ray instance), checks that they
wrote the same rows per split, and prints rows/s and peak memory per worker of each (the ray
engine's workers report their own ``VmHWM`` in ``ingest_report.json``), with a paper estimate
for Criteo 1TB (4.4 billion rows) on N machines from the measured per-worker rates:

    python benchmarks/bench_ingest.py --rows 4000000 --files 8 --engine ray --num-cpus 2 \\
        --out /tmp/bench_ingest_ray --json benchmarks/out/ingest_ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, required=True, help="rows of raw TSV")
    parser.add_argument("--out", required=True, help="work folder (raw/ and ingested/ go here)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--spec", default=str(ROOT / "configs/ingest/criteo_synthetic.yaml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cleanup", action="store_true", help="delete raw/ and ingested/ after")
    parser.add_argument("--engine", choices=["polars", "ray"], default="polars",
                        help="ray: both engines side by side on --files files")
    parser.add_argument("--files", type=int, default=8, help="--engine ray: input files")
    parser.add_argument("--num-cpus", type=int, default=2, help="--engine ray: Ray workers")
    args = parser.parse_args()
    if args.engine == "ray":
        return compare_engines(args)

    out = Path(args.out)
    raw, ingested = out / "raw", out / "ingested"
    datagen_s = _ensure_tsv(raw, args.rows, args.seed)
    files = sorted(raw.glob("part-*.tsv"))
    input_bytes = sum(f.stat().st_size for f in files)

    cmd = [sys.executable, "-m", "embedtrain", "ingest", args.spec, "--input", str(raw / "*.tsv"),
           "--out", str(ingested)]
    wall, peak, stdout = _run(cmd)
    max_rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux

    report = json.loads((ingested / "ingest_report.json").read_text())
    output_bytes = sum(p.stat().st_size for p in ingested.rglob("*.parquet"))
    result = {
        "rows": report["rows_read"],
        "input_files": len(files),
        "input_bytes": input_bytes,
        "output_bytes": output_bytes,
        "wall_s": round(wall, 2),
        "rows_per_s": round(report["rows_read"] / wall),
        "input_mb_per_s": round(input_bytes / wall / 1e6, 1),
        "peak_rss_bytes": max_rss_kib * 1024,
        "peak_rss_polled_bytes": {k: v * 1024 for k, v in peak.items()},
        "phases": report["phases"],
        "rows_written": report["rows_written"],
        "rows_dropped": report["rows_dropped"],
        "datagen_s": datagen_s,
        "command": " ".join(cmd),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "target": "input > 2 GB, peak RSS < 4 GB",
        "target_met": input_bytes > 2e9 and max_rss_kib * 1024 < 4e9,
    }
    _print_table(result)
    print(stdout.strip())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.cleanup:
        import shutil

        shutil.rmtree(raw, ignore_errors=True)
        shutil.rmtree(ingested, ignore_errors=True)


def _run(cmd: list[str]) -> tuple[float, dict[str, int], str]:
    """Runs an ingest command: its wall time, the process's peak resident memory polled every
    0.1 s (KiB: total, anonymous, file-backed) and its stdout; a failure exits with its log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(line.rstrip() for line in child.stderr))
    reader.start()
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    while child.poll() is None:
        for key, kib in _status(child.pid).items():
            peak[key] = max(peak[key], kib)
        time.sleep(0.1)
    wall = time.perf_counter() - start
    reader.join()
    stdout = child.stdout.read()
    if child.returncode != 0:
        sys.exit(f"ingest failed ({child.returncode}):\n" + "\n".join(log[-20:]))
    return wall, peak, stdout


def compare_engines(args) -> None:
    """Both engines on the same ``--files`` files (see the module docstring)."""
    import polars as pl

    out = Path(args.out)
    single = out / "raw"
    datagen_s = _ensure_tsv(single, args.rows, args.seed)
    raw = out / f"raw_{args.files}"
    if not raw.is_dir() or len(list(raw.glob("*.tsv"))) != args.files:
        raw.mkdir(parents=True, exist_ok=True)
        lines = [line for f in sorted(single.glob("part-*.tsv"))
                 for line in f.read_bytes().splitlines(keepends=True)]
        per = -(-len(lines) // args.files)
        for i in range(args.files):
            (raw / f"day_{i:02d}.tsv").write_bytes(b"".join(lines[i * per:(i + 1) * per]))
        del lines
    files = sorted(raw.glob("*.tsv"))
    input_bytes = sum(f.stat().st_size for f in files)
    results = {}
    for engine in ("polars", "ray"):
        target = out / f"ingested_{engine}"
        cmd = [sys.executable, "-m", "embedtrain", "ingest", args.spec, "--input",
               str(raw / "*.tsv"), "--out", str(target), "--quiet", "--engine", engine]
        if engine == "ray":
            cmd += ["--num-cpus", str(args.num_cpus)]
        wall, peak, _ = _run(cmd)
        driver_kib = peak["VmRSS"]
        report = json.loads((target / "ingest_report.json").read_text())
        workers = report["engine"].get("worker_peak_rss_bytes", {})
        results[engine] = {
            "wall_s": round(wall, 2), "rows": report["rows_read"],
            "rows_per_s": round(report["rows_read"] / wall),
            "driver_peak_rss_bytes": driver_kib * 1024,
            "worker_peak_rss_bytes": sorted(workers.values()),
            "phases": report["phases"], "rows_written": report["rows_written"],
            "command": " ".join(cmd)}
        print(f"{engine}: {wall:.1f} s", file=sys.stderr)
    same = results["polars"]["rows_written"] == results["ray"]["rows_written"]
    for split in results["polars"]["rows_written"]:
        a = pl.read_parquet(out / "ingested_polars" / split).sort(pl.all())
        b = pl.read_parquet(out / "ingested_ray" / split).sort(pl.all())
        same = same and a.equals(b)
    estimate = _criteo_1tb_estimate(results["ray"], args.num_cpus)
    result = {"rows": args.rows, "input_files": len(files), "input_bytes": input_bytes,
              "num_cpus": args.num_cpus, "datagen_s": datagen_s, "same_rows_per_split": same,
              **results, "criteo_1tb_estimate": estimate,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    gb = 1e9
    print(f"{'engine':<8} {'wall s':>8} {'rows/s':>11} {'peak RSS (GB)':>32}")
    for engine, r in results.items():
        peak = (f"driver {r['driver_peak_rss_bytes'] / gb:.2f}" + (
            ", workers " + " / ".join(f"{w / gb:.2f}" for w in r["worker_peak_rss_bytes"])
            if r["worker_peak_rss_bytes"] else ""))
        print(f"{engine:<8} {r['wall_s']:>8.1f} {r['rows_per_s']:>11,} {peak:>32}")
        for p in r["phases"]:
            rate = f", {p['rows_per_s']:,} rows/s" if p.get("rows_per_s") else ""
            print(f"  {p['phase']:<16} {p['seconds']:.1f} s{rate}")
    print(f"same rows per split: {same}")
    print("Criteo 1TB (4.4e9 rows) on the ray engine, from the per-worker rates above:")
    for e in estimate["machines"]:
        print(f"  {e['machines']:>3} machine(s) x {estimate['cores_per_machine']} cores: "
              f"{e['hours']:.2f} h")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _criteo_1tb_estimate(ray_result: dict, workers: int, rows: float = 4.4e9,
                         cores: int = 16) -> dict:
    """Hours for ``rows`` on N machines of ``cores`` workers: each per-file pass at the measured
    rows/s per worker, the passes one after the other, perfect scaling (no shared-storage or
    network limit: the estimate is an upper bound on speed)."""
    per_worker = {p["phase"]: p["rows_per_s"] / workers for p in ray_result["phases"]
                  if p.get("rows_per_s")}
    seconds_per_row = sum(1 / r for r in per_worker.values())  # on one worker, all passes
    machines = []
    for n in (1, 4, 16, 64):
        machines.append({"machines": n, "hours": rows * seconds_per_row / (n * cores) / 3600})
    return {"rows": rows, "cores_per_machine": cores, "rows_per_s_per_worker": per_worker,
            "machines": machines}


def _ensure_tsv(raw: Path, rows: int, seed: int) -> float | None:
    """Reuses ``raw`` if it holds this many rows with this seed; else generates it (seconds)."""
    info_path = raw / "datagen.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info["rows"] == rows and info["generator"]["seed"] == seed:
            print(f"reusing {raw} ({rows:,} rows)", file=sys.stderr)
            return None
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    start = time.perf_counter()
    generate_ctr_tsv(CTRDataSpec(rows=rows, seed=seed), raw, progress=False)
    return round(time.perf_counter() - start, 1)


def _status(pid: int) -> dict[str, int]:
    """Resident memory of a running process in KiB (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def _print_table(r: dict) -> None:
    gb = 1e9
    rows = [
        ("input", f"{r['input_bytes'] / gb:.2f} GB raw TSV in {r['input_files']} file(s), "
                  f"{r['rows']:,} rows"),
        ("output", f"{r['output_bytes'] / gb:.2f} GB parquet"),
        ("wall time", f"{r['wall_s']:.1f} s"),
        ("throughput", f"{r['rows_per_s']:,} rows/s, {r['input_mb_per_s']} MB/s of TSV"),
        ("peak RSS", f"{r['peak_rss_bytes'] / gb:.2f} GB (ru_maxrss of the ingest process)"),
        ("  polled", ", ".join(f"{k} {v / gb:.2f} GB" for k, v in
                               r["peak_rss_polled_bytes"].items())),
    ]
    rows += [(f"  {p['phase']}", f"{p['seconds']:.1f} s" + (
        f", {p['rows_per_s']:,} rows/s" if p.get("rows_per_s") else "")) for p in r["phases"]]
    rows.append(("target", f"{r['target']}: {'met' if r['target_met'] else 'NOT met'}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
