"""Which CTR model terms pay off: DLRM, DCNv2 and DeepFM with and without the first-order term
and the embedding L2 penalty, trained on the same rows, against the data set's oracle AUC.

Every variant is a real ``embedtrain train`` subprocess of ``--config`` (default
``configs/dlrm_synthetic.yaml``) on ``--data`` with ``train.select=best`` (the test metrics are
those of the checkpoint with the best validation AUC) and the variant's ``--set`` overrides, in
its own run directory under ``--runs``. The figure is ``summary.json``'s test ``auc`` and its gap to
``oracle_auc`` (the AUC of the true click probability on the test split, from datagen).

Variants (``--variants`` picks some, in this order):

- ``dlrm``, ``dlrm+linear``: dot interaction, without / with ``model.linear``;
- ``dcn``, ``dcn+linear``: DCNv2 (``dcn_num_layers 2``, ``dcn_low_rank_dim 32``, as
  ``configs/dcn_synthetic.yaml``), without / with ``model.linear``;
- ``deepfm-linear``, ``deepfm``: ``model.interaction=fm`` without / with its first-order term;
- any of them with ``@l2=X`` appended (``deepfm@l2=1e-5``) adds ``optim.embedding_l2=X``.

``--oracle-from DIR`` takes the oracle from a datagen set that ``--data`` was re-encoded from
(``configs/ingest/ctr_fm.yaml``, which keeps the datagen's splits and so its test rows).

Without ``--data``, ``embedtrain datagen ctr --structure fm --rows 1000000`` is generated into
``data/fm_1m`` (first-order per-id biases plus pairwise latent-factor interactions between
user-like and item-like fields: the set where the terms should matter).

Usage:
    python benchmarks/bench_ctr_terms.py --json benchmarks/out/ctr_terms.json \\
        [--data data/fm_1m] [--epochs 2] [--variants dlrm,dlrm+linear,...] [--set k=v ...]

Prints a table; JSON: ``oracle_auc``, ``runs`` (per variant: ``overrides``, test ``auc``,
``gap`` to the oracle, ``selected_step``, ``steps``, ``train_time_s``, ``run_dir``), ``command``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DCN = ["model.interaction=dcn", "model.dcn_num_layers=2", "model.dcn_low_rank_dim=32"]
VARIANTS = {
    "dlrm": ["model.interaction=dot", "model.linear=false"],
    "dlrm+linear": ["model.interaction=dot", "model.linear=true"],
    "dcn": [*DCN, "model.linear=false"],
    "dcn+linear": [*DCN, "model.linear=true"],
    "deepfm-linear": ["model.interaction=fm", "model.linear=false"],
    "deepfm": ["model.interaction=fm", "model.linear=true"],
}


def variant_overrides(name: str) -> list[str]:
    """The ``--set`` overrides of a variant name (``base[@l2=X]``)."""
    base, _, l2 = name.partition("@l2=")
    if base not in VARIANTS:
        raise SystemExit(f"--variants: unknown variant {base!r} (known: {', '.join(VARIANTS)})")
    return VARIANTS[base] + ([f"optim.embedding_l2={l2}"] if l2 else [])


def train(config: str, data: Path, out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "embedtrain", "train", config, "--out", str(out), "--overwrite",
           "--set", f"data.path={data}"]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["_wall_s"] = time.perf_counter() - start
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--config", default="configs/dlrm_synthetic.yaml")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--set", dest="sets", action="append", default=[],
                   help="more overrides for every variant (repeatable)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_ctr_terms")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--oracle-from", type=Path, default=None,
                   help="the datagen data set --data was ingested from (configs/ingest/ctr_fm.yaml "
                        "keeps its splits): its metadata.json gives the oracle test AUC")
    args = p.parse_args(argv)

    data = args.data
    if data is None:
        data = ROOT / "data" / "fm_1m"
        if not (data / "metadata.json").exists():
            subprocess.run([sys.executable, "-m", "embedtrain", "datagen", "ctr", "--structure",
                            "fm", "--rows", "1000000", "--out", str(data)], cwd=ROOT, check=True)
    data = data.resolve()
    names = [v for v in args.variants.split(",") if v]
    common = ["train.select=best", f"train.epochs={args.epochs}", *args.sets]
    runs, oracle = {}, None
    if args.oracle_from is not None:
        oracle = json.loads((args.oracle_from / "metadata.json").read_text())["oracle_auc"]["test"]
    print(f"{'variant':<24} {'test AUC':>9} {'oracle':>8} {'gap':>8} {'best step':>9} "
          f"{'train s':>8}", flush=True)
    for name in names:
        overrides = common + variant_overrides(name)
        s = train(args.config, data, args.runs / name.replace("@", "_").replace("=", ""),
                  overrides)
        oracle = s.get("oracle_auc") or oracle
        gap = s["auc"] - oracle if oracle is not None else None
        runs[name] = {"overrides": overrides, "auc": s["auc"], "gap": gap,
                      "selected_step": (s.get("selected") or {}).get("step"),
                      "steps": s["steps"], "train_time_s": s["train_time_s"],
                      "wall_s": round(s["_wall_s"], 1),
                      "run_dir": str(args.runs / name)}
        print(f"{name:<24} {s['auc']:>9.4f} {oracle or float('nan'):>8.4f} "
              f"{gap if gap is not None else float('nan'):>+8.4f} "
              f"{runs[name]['selected_step'] or '-':>9} {s['train_time_s']:>8.0f}", flush=True)
    result = {"data": str(data), "config": args.config, "epochs": args.epochs,
              "oracle_auc": oracle, "runs": runs,
              "command": "python benchmarks/bench_ctr_terms.py " + " ".join(argv or sys.argv[1:])}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
