"""Shared test set-up: the world-of-one process group some tests create is closed at the end;
``quiet_torchrec`` silences TorchRec's planner logging and warnings for a module that asks;
:func:`run_cli` runs an ``embedtrain`` command in the test's own process, :func:`run_ranks` a
world of one there too.

``build_run`` joins a process group (a world of one, as ``embedtrain train`` does); destroying it
before pytest exits keeps gloo's threads from outliving the interpreter's finalization (see
``embedtrain.processes``).
"""

import contextlib
import io
import logging
import subprocess
import warnings
from pathlib import Path

import pytest

import embedtrain  # noqa: F401  (before any test imports TorchRec: embedtrain/fbgemm_cpu.py)

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``embedtrain ARGS`` run in this process, as a subprocess would report it (exit status,
    stdout, stderr), without a new interpreter's start-up: importing torch and TorchRec costs a
    subprocess ~6 s on 2 cores, most of a tiny run. The run directory locks a ``train`` takes
    are released at the end, as its process's exit would. For one process only: ``--nproc``
    still launches torchrun, and what needs a process of its own (signals, a second writer, a
    module not importable from ``cwd``) runs as one.
    """
    from embedtrain.cli import main
    from embedtrain.train import run_dir

    held = set(run_dir._HELD)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help or a usage error, already printed
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for key in set(run_dir._HELD) - held:
        run_dir.RunDir(key).unlock()
    return subprocess.CompletedProcess(["embedtrain", *args], code, out.getvalue(),
                                       err.getvalue())


def train_tiny_ctr(root: Path) -> tuple[Path, Path]:
    """A tiny CTR data set under ``root/data`` and a 6-step run of it at ``root/run``
    (checkpoints at steps 3 and 6); ``(data, run)``."""
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(root / "data", rows=2000)
    config = root / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, num_workers: 0}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{max_steps: 6, eval_every: 0, checkpoint_every: 3, progress: false}}
""")
    r = run_cli("train", str(config), "--out", str(root / "run"))
    assert r.returncode == 0, r.stderr
    return data, root / "run"


def file_bytes(top: Path) -> dict[str, bytes]:
    """Every file under ``top`` (relative path -> content): to show a command changed none."""
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


def run_ranks(fn, world_size: int, *args, **kwargs) -> list:
    """:func:`embedtrain.processes.spawn` (``fn(rank, world_size, *args)`` on gloo ranks), but a
    world of one runs in this process, in its world-of-one group (as ``build_run`` joins one):
    no new interpreter to start for a single rank."""
    if world_size > 1:
        from embedtrain.processes import spawn

        return spawn(fn, world_size, *args, **kwargs)
    from embedtrain.train.dist import init_process_group

    init_process_group()
    return [fn(0, 1, *args)]


@pytest.fixture
def quiet_torchrec():
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(autouse=True, scope="session")
def _close_process_group():
    yield
    from embedtrain.processes import destroy_process_group

    destroy_process_group()
