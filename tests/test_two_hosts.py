"""Two hosts: two ``torchrun --nnodes 2 --nproc-per-node 1`` launchers with a c10d rendezvous on
127.0.0.1, each in a working directory of its own (as two machines would be), train, checkpoint,
resume and evaluate exactly as ``--nproc 2`` on one host: the same examples and the same AUC.
The run directory is on a path both "hosts" see (a real cluster: a shared filesystem)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from embedtrain.processes import free_port
from embedtrain.testing import tiny_ctr_dataset


def _two_hosts(tmp_path: Path, config: Path, out: Path, *extra: str) -> None:
    port, procs = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    for node in (0, 1):
        cwd = tmp_path / f"host{node}"
        cwd.mkdir(exist_ok=True)
        log = open(cwd / f"{out.name}.log", "a")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
             "1", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", out.name, "-m", "embedtrain", "train", str(config),
             "--out", str(out), *extra], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT),
            cwd / f"{out.name}.log"))
    for proc, log in procs:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]


@pytest.mark.slow
def test_two_launchers_train_resume_and_evaluate_as_two_local_ranks(tmp_path):
    data = tiny_ctr_dataset(tmp_path / "data", rows=4000)
    config = tmp_path / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, num_workers: 0}}
model: {{embedding_dim: 8, bottom_mlp: [16], top_mlp: [16]}}
train: {{max_steps: 6, eval_every: 3, checkpoint_every: 3, progress: false}}
""")
    hosts, local = tmp_path / "run_hosts", tmp_path / "run_local"
    _two_hosts(tmp_path, config, hosts)
    r = run_cli("train", str(config), "--out", str(local), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    # resumed from their checkpoints, two more evaluations
    _two_hosts(tmp_path, config, hosts, "--resume", "--set", "train.max_steps=12")
    r = run_cli("train", str(config), "--out", str(local), "--nproc", "2", "--resume",
                "--set", "train.max_steps=12")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads((run / "summary.json").read_text()) for run in (hosts, local))
    assert a["world_size"] == b["world_size"] == 2
    assert (a["steps"], a["examples"]) == (b["steps"], b["examples"]) == (12, b["examples"])
    assert a["auc"] == b["auc"]
    assert [p.name for p in sorted((hosts / "checkpoints").iterdir())] == \
        [p.name for p in sorted((local / "checkpoints").iterdir())]
    evals = [json.loads(run_cli("eval", str(run), "--split", "valid").stdout) for run in
             (hosts, local)]
    assert evals[0] == evals[1]
