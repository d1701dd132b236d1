"""Process settings (embedtrain.runtime): torch-free light commands, threads per rank, allocator."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedtrain import runtime
from embedtrain.testing import tiny_ctr_dataset

ROOT = Path(__file__).resolve().parent.parent

# Runs the console entry with these arguments; at exit (sys.exit runs atexit, os._exit would
# not) says whether torch was imported.
_PROBE = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("TORCH=%d\\n" % ("torch" in sys.modules)))
sys.argv = ["embedtrain", *sys.argv[1:]]
from embedtrain.cli import entry
entry()
"""


def _probe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def raw_tsv(tmp_path_factory):
    from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv

    out = tmp_path_factory.mktemp("tsv")
    generate_ctr_tsv(CTRDataSpec(rows=600), out, progress=False)
    return next(out.glob("*.tsv"))


@pytest.mark.parametrize("command", ["help", "plan help", "train help", "datagen", "ingest"])
def test_light_commands_import_no_torch(command, raw_tsv, tmp_path):
    args = {
        "help": ["--help"],
        "plan help": ["plan", "--help"],
        "train help": ["train", "--help"],
        "datagen": ["datagen", "ctr", "--rows", "500", "--out", str(tmp_path / "ctr")],
        "ingest": ["ingest", "configs/ingest/criteo_synthetic.yaml", "--input", str(raw_tsv),
                   "--out", str(tmp_path / "ingested")],
    }[command]
    r = _probe(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TORCH=0" in r.stderr, f"embedtrain {' '.join(args)} imported torch"


def test_threads_per_rank_config_then_environment_then_cores(monkeypatch):
    monkeypatch.delenv("EMBEDTRAIN_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(runtime, "usable_cores", lambda: 8)
    assert runtime.threads_per_rank(None) == (4, "cores / local ranks = 8 / 2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert runtime.threads_per_rank(None)[0] == 1  # never 0
    monkeypatch.setenv("EMBEDTRAIN_THREADS", "3")
    assert runtime.threads_per_rank(None) == (3, "EMBEDTRAIN_THREADS")
    assert runtime.threads_per_rank(5) == (5, "train.threads_per_rank")
    monkeypatch.setenv("EMBEDTRAIN_THREADS", "two")
    with pytest.raises(ValueError, match="EMBEDTRAIN_THREADS"):
        runtime.threads_per_rank(None)


def test_loader_threads_configured_else_none_where_the_step_takes_every_core(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(runtime, "usable_cores", lambda: 8)
    assert runtime.loader_threads(None, False, 4) == 0  # 2 ranks x 4 threads: every core
    assert runtime.loader_threads(None, False, 3) == 2  # two cores to spare
    assert runtime.loader_threads(None, True, 4) == 2  # a GPU step: reading overlaps it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert runtime.loader_threads(None, False, 4) == 2
    assert runtime.loader_threads(None, False, 8) == 0
    assert runtime.loader_threads(1, False, 8) == 1 and runtime.loader_threads(0, True, 1) == 0


# Allocates a 64 MiB block (above glibc's largest dynamic mmap threshold): glibc's defaults
# serve it by mmap (mapped bytes, mallinfo2().hblkhd, rise while it lives); tuned, the heap;
# tuned, then fitted to a rank holding argv[1] bytes of tables and heads: mapped again if large.
_MALLOC_PROBE = """
import ctypes, sys
from embedtrain.runtime import fit_allocator, tune_allocator
print(tune_allocator())
if int(sys.argv[1]) >= 0:
    print(fit_allocator(int(sys.argv[1])))
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print("MAPPED", mapped)
"""


@pytest.mark.parametrize("setting,held", [
    ("tuned", -1), ("tuned", 0), ("tuned", 1 << 60), ("default", 1 << 60), ("user", 1 << 60)])
def test_allocator_keeps_large_blocks_in_the_heap_unless_told(setting, held):
    env = {"tuned": {}, "default": {"EMBEDTRAIN_MALLOC": "default"},
           "user": {"MALLOC_MMAP_THRESHOLD_": "65536"}}[setting]
    base = {k: v for k, v in os.environ.items()
            if k not in ("EMBEDTRAIN_MALLOC", *runtime._USER_MALLOC_VARS)}
    r = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, str(held)], capture_output=True,
                       text=True, env={**base, **env}, timeout=60)
    assert r.returncode == 0, r.stderr
    said, mapped = r.stdout.splitlines()[-2], int(r.stdout.split("MAPPED")[1])
    if setting == "tuned" and held == 1 << 60:  # the run's tables fill memory: mapped again
        assert said.startswith("glibc: blocks >= 1 MiB mapped") and mapped >= 64 << 20
    elif setting == "tuned":  # none held, or little: the heap keeps the block
        assert said.startswith("glibc: no mmap per block") and mapped == 0
    else:
        assert mapped >= 64 << 20  # glibc's own rule (or the user's): a mapped block
        assert said == ("glibc defaults (EMBEDTRAIN_MALLOC=default)" if setting == "default"
                        else "as set by MALLOC_MMAP_THRESHOLD_")


def test_run_banner_and_summary_say_threads_and_startup(tmp_path):
    data = tiny_ctr_dataset(tmp_path / "data", rows=2000)
    config = tmp_path / "tiny.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 256}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [32, 1]}}
train: {{max_steps: 3, eval_every: 0, progress: false, threads_per_rank: 1}}
""")
    r = subprocess.run([sys.executable, "-m", "embedtrain", "train", str(config), "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # one torch thread leaves a core to spare on 2 or more: auto gives the loader 2 threads
    loader = runtime.loader_threads(None, False, 1)
    # one torch thread: the tables' backward keeps FBGEMM's single thread (fbgemm_threads)
    assert (f"threads: 1 per rank (train.threads_per_rank); loader threads: {loader} "
            "(data.num_workers: auto); table backward threads: 1; allocator: glibc: no mmap"
            ) in r.stderr
    import json

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["loader_threads_per_rank"] == loader
    assert summary["table_backward_threads_per_rank"] == 1
    parts = summary["startup"]
    assert list(parts) == ["imports_s", "torch_s", "libraries_s", "build_s", "first_batch_s"]
    assert summary["startup_s"] > 0 and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(summary["startup_s"], abs=0.01)


def test_startup_of_a_run_counts_from_its_own_start_where_the_process_ran_before(monkeypatch):
    """The command line's run counts start-up from the process's start; a later run in the same
    process (a search's trial in a reused worker) or one started from Python counts from its
    own begin, without the marks of the runs before it."""
    from embedtrain import runtime

    now = [200.0]
    monkeypatch.setattr(runtime.time, "time", lambda: now[0])
    monkeypatch.setattr(runtime, "process_start_time", lambda: 90.0)
    monkeypatch.setattr(runtime, "_RUN_STARTED_AT", None)
    monkeypatch.setattr(runtime, "_RUNS", 0)
    monkeypatch.setattr(runtime, "_MARKS", {"imports": 100.0})  # `embedtrain train` marked it
    runtime.begin_run()
    runtime.mark("build")
    first = runtime.startup_record(210.0)
    assert first == {"startup_s": 120.0, "startup": {"imports_s": 10.0, "build_s": 100.0,
                                                     "first_batch_s": 10.0}}
    now[0] = 500.0
    runtime.begin_run()  # the next trial in this worker
    runtime.mark("build")
    now[0] = 530.0
    assert runtime.startup_record(540.0) == {"startup_s": 40.0, "startup": {
        "build_s": 0.0, "first_batch_s": 40.0}}
    monkeypatch.setattr(runtime, "_RUNS", 0)
    monkeypatch.setattr(runtime, "_MARKS", {})  # a notebook's first fit: no command line
    now[0] = 500.0
    runtime.begin_run()
    assert runtime.startup_record(512.0)["startup_s"] == 12.0
