"""Two "hosts" against two local ranks: the same run, the same numbers.

Trains CONFIG twice with two ranks: (a) two ``torchrun --nnodes 2 --nproc-per-node 1``
launchers with a c10d rendezvous on 127.0.0.1, each in a working directory of its own (as two
machines would be; the run directory on a path both see, as a shared filesystem would be), and
(b) ``embedtrain train --nproc 2`` on one host. Both with ``EMBEDTRAIN_THREADS=1`` (one thread a
rank in both, so the float reductions are the same). Prints both summaries' test metrics,
example counts and wall times, and writes them as JSON.

    python benchmarks/bench_two_hosts.py configs/dlrm_synthetic.yaml --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("auc", "ne", "logloss", "calibration", "steps", "examples", "world_size")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_hosts(config: Path, out: Path, work: Path, env: dict[str, str]) -> float:
    """Two launchers, one rank each, rendezvous on 127.0.0.1; their wall time."""
    port, procs, start = _port(), [], time.perf_counter()
    for node in (0, 1):
        cwd = work / f"host{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        log = open(cwd / "train.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
             "1", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "bench", "-m", "embedtrain", "train",
             str(config), "--out", str(out), "--no-progress"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), cwd / "train.log"))
    for proc, log in procs:
        if proc.wait() != 0:
            sys.exit(f"two hosts: a launcher failed:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def one_host(config: Path, out: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "embedtrain", "train", str(config), "--out",
                        str(out), "--nproc", "2", "--no-progress"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"--nproc 2 failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="training config (paths relative to it)")
    p.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="two_hosts_"))
    env = {**os.environ, "EMBEDTRAIN_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    config = args.config.resolve()
    seconds = {"two_hosts": two_hosts(config, work / "run_hosts", work, env),
               "nproc_2": one_host(config, work / "run_local", env)}
    runs = {name: json.loads((work / run / "summary.json").read_text())
            for name, run in (("two_hosts", "run_hosts"), ("nproc_2", "run_local"))}
    rows = {name: {k: s.get(k) for k in KEYS} for name, s in runs.items()}
    same = rows["two_hosts"] == rows["nproc_2"]
    print(f"{'':<10}" + "".join(f"{k:>14}" for k in KEYS) + f"{'wall s':>10}")
    for name, row in rows.items():
        print(f"{name:<10}" + "".join(f"{v:>14.6g}" if isinstance(v, float) else f"{v:>14}"
                                      for v in row.values()) + f"{seconds[name]:>10.1f}")
    print(f"identical: {same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": str(args.config), "runs": rows,
                                         "wall_s": seconds, "identical": same}, indent=2))


if __name__ == "__main__":
    main()
