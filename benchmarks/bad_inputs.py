"""Bad inputs sweep (issue 52): bad configs, checkpoints, data and exports, fed to the CLI the way
a careless user and an attacker would, each classified good, poor or bad.

Each case (the table ``CASES``) builds its inputs in a directory of its own (from the project's
helpers: ``tiny_ctr_dataset``, ``tiny_xc_dataset``, ``tiny_graph_dataset``, ``tiny_seq_dataset``,
and a tiny trained CTR and XC run and their exports, made once), runs one
``python -m embedtrain ...`` in a fresh process (cwd: the case's directory, ``--timeout`` seconds)
and states what it expects:

- ``refuse``: a non-zero exit and a one-line message naming ``must`` (file, key or column, row),
  within ``max_s`` seconds where the case sets it;
- ``accept``: exit 0, ``report`` in the output (a count or warning) and the case's ``check``;
- ``either``: a refusal judged as ``refuse``, an exit 0 as ``accept``.

Verdicts (the predicates below):

- bad: a traceback, a Rust panic, a hang (timeout), a marker file written by code a data file
  smuggled in, a read-only input or an existing run/export changed (every file of the shared
  fixtures and of the case's protected paths hashed before and after; a run's ``.lock`` aside:
  the writer lock, where whoever takes it writes its PID), exit 0 where the case must be refused,
  or output written despite a refusal (for ``train``: checkpoints, metrics or a summary);
- poor: refused without a traceback, but the message is more than one line, lacks a ``must``
  substring or came slower than the case's ``max_s``; or accepted without the count/warning
  expected; or refused where it should have been accepted;
- good: what the case expects.

The message is stderr from its first ``embedtrain CMD: error:`` line on (the status and warning
lines a command prints before it, ``data: ...``, ``warning: ... trying an older checkpoint``, are
not part of it); without such a line, all of stderr. Each case's process runs in a session of its
own (killed whole on timeout) with its address space capped at 12 GiB.

Usage:
    python benchmarks/bad_inputs.py [--json benchmarks/out/bad_inputs.json] [--only SUBSTR]
        [--keep DIR] [--timeout 60]

Prints a table (case, command, verdict, the message's first line cut to 100 characters; paths
shown relative to the case's directory, or the work directory for the shared fixtures), then
``good N, poor N, bad N``; writes JSON: ``counts``, ``cases`` (per case: name, family, command,
expectation, verdict, reasons, exit status, seconds, the message's and stderr's first lines),
``seconds``, ``command``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import pickle
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_JSON = ROOT / "benchmarks" / "out" / "bad_inputs.json"
MEMORY_LIMIT = 12 * 2**30  # address space of each case's process: a runaway allocation fails
MSG_CHARS = 100


# ---------------------------------------------------------------- the hostile payload


class _Payload:
    """Unpickling it runs ``touch MARKER`` (what an attacker's pickle would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---------------------------------------------------------------- cases


@dataclasses.dataclass
class Setup:
    """What a case's builder made: the command and the paths the verdict looks at."""

    argv: list[str]  # after `python -m embedtrain`
    protect: list[Path] = dataclasses.field(default_factory=list)  # unchanged, whatever happens
    protect_on_refusal: list[Path] = dataclasses.field(default_factory=list)  # unchanged if refused
    outputs: list[Path] = dataclasses.field(default_factory=list)  # absent after a refusal
    cleanup: Optional[Callable[[], None]] = None


@dataclasses.dataclass
class Case:
    name: str
    family: str
    build: Callable[["Ctx", Path], Setup]
    expect: str  # refuse | accept | either
    must: tuple[str, ...] = ()  # a refusal: its message names each
    max_s: Optional[float] = None  # a refusal: within this many seconds (the whole process)
    report: tuple[str, ...] = ()  # an acceptance: each in stdout + stderr (a count, a warning)
    check: Optional[Callable[[Path], Optional[str]]] = None  # an acceptance: None if fine


@dataclasses.dataclass
class Result:
    rc: Optional[int]  # None: timed out
    stdout: str
    stderr: str
    seconds: float


class Ctx:
    """The shared fixtures, built once under ``work/base`` (hashed around every case)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.base = work / "base"
        self.ctr, self.xc = self.base / "ctr", self.base / "xc"
        self.graph, self.seq = self.base / "graph", self.base / "seq"
        self.ctr_yaml = self.base / "ctr.yaml"
        self.run, self.export = self.base / "run", self.base / "export"
        self.xrun, self.xexport = self.base / "xrun", self.base / "xexport"

    def copy(self, src: Path, dst: Path) -> Path:
        shutil.copytree(src, dst)
        return dst

    def ctr_config(self, d: Path, data: Path, name: str = "cfg.yaml") -> Path:
        return write(d / name, CTR_YAML.format(data=data))

    def edit_ctr_train(self, d: Path, edit: Callable) -> Path:
        """A copy of the CTR data set whose train parquet is ``edit(table)``."""
        import pyarrow.parquet as pq

        data = self.copy(self.ctr, d / "data")
        path = data / "train" / "part-00000.parquet"
        pq.write_table(edit(pq.read_table(path)), path)
        return data


CTR_YAML = """\
data: {{path: {data}, batch_size: 128, eval_batch_size: 512, num_workers: 0}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{max_steps: 2, eval_every: 0, checkpoint_every: 1, progress: false}}
"""
XC_SETS = ["data.batch_size=128", "data.eval_batch_size=512", "data.num_workers=0",
           "xc.embedding_dim=8", "xc.mlp=[16,8]", "head.kind=full", "train.eval_every=0",
           "train.checkpoint_every=2", "train.max_steps=2", "train.progress=false"]
GNN_YAML = """\
task: gnn_node
data: {{path: {data}, batch_size: 64, eval_batch_size: 256, num_workers: 0}}
gnn: {{fanouts: [5, 5], hidden: [16, 16], embedding_dim: 8}}
train: {{max_steps: 2, eval_every: 0, checkpoint_every: 100, progress: false}}
"""
SEQ_YAML = """\
task: seq
data: {{path: {data}, batch_size: 64, eval_batch_size: 256, num_workers: 0}}
seq: {{dim: 8, layers: 1, heads: 1}}
head: {{kind: full, top_k: [10]}}
train: {{max_steps: 2, eval_every: 0, checkpoint_every: 100, progress: false}}
"""
SPEC = ("input: {{format: {fmt}}}\nlabel: clicked\ndense: [{{name: price}}]\n"
        "sparse: [{{name: user_id}}]\nsplit: {{valid_fraction: 0, test_fraction: 0}}\n")
CSV_SPEC = SPEC.format(fmt="csv")
GOOD_CSV = "clicked,price,user_id\n1,1.5,a\n0,2,b\n1,3,a\n0,4,c\n"


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def marker(d: Path) -> Path:
    return d / "MARKER"


def run_outputs(run: Path) -> list[Path]:
    """What a training run writes once it trains: a refused ``train`` must leave none."""
    return [run / "checkpoints", run / "summary.json", run / "metrics.jsonl"]


def laughs(depth: int, tail: str) -> str:
    """A "billion laughs" YAML document: 10**depth strings once its aliases expand."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, depth + 1)]
    return "\n".join(lines) + "\n" + tail.format(depth=depth) + "\n"


def set_column(table, name: str, values, type_=None):
    import pyarrow as pa

    i = table.schema.get_field_index(name)
    return table.set_column(i, name, pa.array(values, type_ or table.schema.field(name).type))


# --- configs ---------------------------------------------------------------------------------


def _cfg(text: str | bytes) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        body = text.replace("MARKER_PATH", str(marker(d))) if isinstance(text, str) else text
        write(d / "cfg.yaml", body)
        return Setup(["train", "cfg.yaml", "--out", "run"], outputs=[d / "run"])
    return build


def _cfg_set(*sets: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        ctx.ctr_config(d, ctx.ctr)
        argv = ["train", "cfg.yaml", "--out", "run"]
        for s in sets:
            argv += ["--set", s]
        return Setup(argv, outputs=run_outputs(d / "run"))
    return build


def _cfg_dir(ctx: Ctx, d: Path) -> Setup:
    (d / "configs_dir").mkdir()
    return Setup(["train", "configs_dir", "--out", "run"], outputs=[d / "run"])


def _cluster_hosts(ctx: Ctx, d: Path) -> Setup:
    text = (ROOT / "configs/clusters/cpu-1x2.yaml").read_text().replace("hosts: 1\n",
                                                                         "hosts: 1000000\n")
    write(d / "cluster.yaml", text)
    return Setup(["plan", str(ctx.ctr_yaml), "--cluster", "cluster.yaml", "--out", "plan"],
                 outputs=[d / "plan"])


def _hosts_sweep(ctx: Ctx, d: Path) -> Setup:
    return Setup(["plan", str(ctx.ctr_yaml), "--cluster",
                  str(ROOT / "configs/clusters/cpu-1x2.yaml"), "--hosts", "1..100000",
                  "--out", "plan"], outputs=[d / "plan"])


# --- checkpoints and runs --------------------------------------------------------------------


def _poisoned_run(ctx: Ctx, d: Path) -> Path:
    run = ctx.copy(ctx.run, d / "myrun")
    for meta in run.glob("checkpoints/*/.metadata"):
        meta.write_bytes(pickle.dumps(_Payload(marker(d))))
    return run


def _ckpt_pickle(command: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        run = _poisoned_run(ctx, d)
        argv = {"eval": ["eval", "myrun"],
                "export": ["export", "myrun", "--out", "exp", "--no-progress"],
                "resume": ["train", "myrun/config.yaml", "--out", "myrun", "--resume",
                           "--set", "train.max_steps=3"]}[command]
        return Setup(argv, protect=[run], outputs=[d / "exp"])
    return build


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").iterdir())[-1]


def _ckpt_edit(edit: Callable[[Path], None], command: str,
               protect_always: bool = True) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        run = ctx.copy(ctx.run, d / "myrun")
        edit(run)
        argv = {"eval": ["eval", "myrun"],
                "resume": ["train", "myrun/config.yaml", "--out", "myrun", "--resume",
                           "--set", "train.max_steps=3"]}[command]
        if protect_always:
            return Setup(argv, protect=[run])
        return Setup(argv, protect_on_refusal=[run])
    return build


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncate_rank(run: Path) -> None:
    _truncate(_newest(run) / "rank_00000.pt")


def _drop_rank(run: Path) -> None:
    (_newest(run) / "rank_00000.pt").unlink()


def _truncate_distcp(run: Path) -> None:
    for f in run.glob("checkpoints/*/__0_0.distcp"):
        _truncate(f)


def _garbage_state(run: Path) -> None:
    for f in run.glob("checkpoints/*/trainer_state.json"):
        f.write_text("{not json")


def _drop_config(run: Path) -> None:
    (run / "config.yaml").unlink()


def _train_over_run(ctx: Ctx, d: Path) -> Setup:
    run = ctx.copy(ctx.run, d / "myrun")
    return Setup(["train", str(ctx.ctr_yaml), "--out", "myrun"], protect=[run])


def _export_into_run(ctx: Ctx, d: Path) -> Setup:
    run = ctx.copy(ctx.run, d / "myrun")
    return Setup(["export", "myrun", "--out", "myrun", "--no-progress"], protect=[run])


def _eval_args(*args: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        return Setup(["eval", str(ctx.run), *args])
    return build


# --- exports and predict ---------------------------------------------------------------------


def _predict(ctx: Ctx, d: Path, export: Path, *extra: str, inputs: Optional[Path] = None,
             out: str = "p.parquet", **kw) -> Setup:
    src = inputs or ctx.ctr / "test"
    return Setup(["predict", str(export), "--input", str(src), "--out", out, "--no-progress",
                  *extra], outputs=[d / out], **kw)


def _component_module(path: str) -> Callable[[Ctx, Path], Setup]:
    """An export whose config.yaml names a model and a task module beside it: predict must
    serve it without importing them."""
    def build(ctx: Ctx, d: Path) -> Setup:
        import yaml

        export = ctx.copy(ctx.export, d / "exp")
        config = export / "config.yaml"
        raw = yaml.safe_load(config.read_text())
        raw["model"], raw["task"] = {"_component_": path}, {"_component_": path}
        config.write_text(yaml.safe_dump(raw))
        write(d / "some_module.py", f"open({str(marker(d))!r}, 'w').close()\n")
        return _predict(ctx, d, export)
    return build


def _dense_program(kind: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        export = ctx.copy(ctx.export, d / "exp")
        program = export / "dense.pt2"
        if kind == "truncated":
            _truncate(program)
        else:
            program.write_bytes(pickle.dumps(_Payload(marker(d))))
        return _predict(ctx, d, export, protect=[export])
    return build


def _pickled_table(ctx: Ctx, d: Path) -> Setup:
    import numpy as np

    export = ctx.copy(ctx.export, d / "exp")
    table = export / "tables" / "t_C1.npy"
    with open(table, "wb") as f:
        np.save(f, np.array([_Payload(marker(d))], dtype=object), allow_pickle=True)
    return _predict(ctx, d, export, protect=[export])


def _no_model_json(ctx: Ctx, d: Path) -> Setup:
    export = ctx.copy(ctx.export, d / "exp")
    (export / "model.json").unlink()
    return _predict(ctx, d, export, protect=[export])


def _topk(ctx: Ctx, d: Path) -> Setup:
    return _predict(ctx, d, ctx.xexport, "--top-k", "50", inputs=ctx.xc / "test")


def _predict_label_3(ctx: Ctx, d: Path) -> Setup:
    import pyarrow.parquet as pq

    table = pq.read_table(ctx.ctr / "test" / "part-00000.parquet")
    labels = table.column("label").to_pylist()
    labels[7] = 3
    pq.write_table(set_column(table, "label", labels), d / "rows.parquet")
    return _predict(ctx, d, ctx.export, inputs=d / "rows.parquet", protect=[d / "rows.parquet"])


def _readonly_out(ctx: Ctx, d: Path) -> Setup:
    ro = d / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    immutable = os.geteuid() == 0  # root writes through a mode of 555: make it immutable
    if immutable:
        subprocess.run(["chattr", "+i", str(ro)], check=True)

    def cleanup() -> None:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=False)
        ro.chmod(0o755)
    return _predict(ctx, d, ctx.export, out="ro/p.parquet", cleanup=cleanup)


def _out_is_input(ctx: Ctx, d: Path) -> Setup:
    inputs = ctx.copy(ctx.ctr / "test", d / "inputs")
    setup = _predict(ctx, d, ctx.export, inputs=inputs / "part-00000.parquet",
                     out="inputs/part-00000.parquet", protect=[inputs])
    setup.outputs = []
    return setup


def _predict_args(*args: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        return _predict(ctx, d, ctx.export, *args)
    return build


def _predict_no_match(ctx: Ctx, d: Path) -> Setup:
    return _predict(ctx, d, ctx.export, inputs=d / "nope" / "*.parquet")


def _export_over_export(ctx: Ctx, d: Path) -> Setup:
    export = ctx.copy(ctx.export, d / "exp")
    return Setup(["export", str(ctx.run), "--out", "exp", "--no-progress"], protect=[export])


def _export_quantize(ctx: Ctx, d: Path) -> Setup:
    return Setup(["export", str(ctx.run), "--out", "exp", "--quantize", "int3", "--no-progress"],
                 outputs=[d / "exp"])


# --- ingest ----------------------------------------------------------------------------------


def _ingest(data: str | bytes, name: str = "in.csv", spec: str = CSV_SPEC,
            extra: tuple[str, ...] = ()) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        body = spec.replace("MARKER_PATH", str(marker(d)))
        write(d / "spec.yaml", body)
        write(d / name, data)
        return Setup(["ingest", "spec.yaml", "--input", name, "--out", "out", "--quiet", *extra],
                     protect=[d / name], outputs=[d / "out"])
    return build


def _ingest_uint64(ctx: Ctx, d: Path) -> Setup:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write(d / "spec.yaml", SPEC.format(fmt="parquet"))
    pq.write_table(pa.table({
        "clicked": pa.array([1, 0, 1, 0], pa.int8()), "price": [1.0, 2.0, 3.0, 4.0],
        "user_id": pa.array([1, 2**63 + 5, 2**64 - 1, 7], pa.uint64())}), d / "in.parquet")
    return Setup(["ingest", "spec.yaml", "--input", "in.parquet", "--out", "out", "--quiet"],
                 protect=[d / "in.parquet"], outputs=[d / "out"])


def _ingest_onto_run(ctx: Ctx, d: Path) -> Setup:
    run = ctx.copy(ctx.run, d / "myrun")
    write(d / "spec.yaml", CSV_SPEC)
    write(d / "in.csv", GOOD_CSV)
    return Setup(["ingest", "spec.yaml", "--input", "in.csv", "--out", "myrun", "--quiet"],
                 protect=[run])


GRAPH_SPEC = "kind: graph\nedges: {format: csv, src: src, dst: dst}\nsplit: {method: random}\n"
XC_SPEC = ("kind: xc\ninput: {format: csv}\ntokens: {separator: ' '}\n"
           "labels: {column: label, encoding: pre_encoded, num_classes: 3}\n"
           "split: {valid_fraction: 0, test_fraction: 0}\n")


# --- training on a prepared data set -------------------------------------------------------


def _train_edit(edit: Callable) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        data = ctx.edit_ctr_train(d, edit)
        ctx.ctr_config(d, data)
        return Setup(["train", "cfg.yaml", "--out", "run"], protect=[data],
                     outputs=run_outputs(d / "run"))
    return build


def _long_lists(table):
    import pyarrow as pa

    values = table.column("C24").to_pylist()
    values[3] = [i % 128 for i in range(50)]
    return set_column(table, "C24", values, pa.list_(pa.int64()))


def _list_in_single(table):
    import pyarrow as pa

    values = [[v] for v in table.column("C1").to_pylist()]
    values[3] = [values[3][0], (values[3][0] + 1) % 15]
    return set_column(table, "C1", values, pa.list_(pa.int64()))


def _id_at(column: str, value: int):
    def edit(table):
        values = table.column(column).to_pylist()
        values[3] = value
        return set_column(table, column, values)
    return edit


def _label_3(table):
    labels = table.column("label").to_pylist()
    labels[5] = 3
    return set_column(table, "label", labels)


def _drop_c5(table):
    return table.drop(["C5"])


def _train_meta(ctx: Ctx, d: Path) -> Setup:
    data = ctx.copy(ctx.ctr, d / "data")
    meta = json.loads((data / "metadata.json").read_text())
    meta["sparse"][0]["num_embeddings"] = 2**70
    (data / "metadata.json").write_text(json.dumps(meta, indent=2))
    ctx.ctr_config(d, data)
    return Setup(["train", "cfg.yaml", "--out", "run"], protect=[data],
                 outputs=run_outputs(d / "run"))


def _train_truncated_parquet(ctx: Ctx, d: Path) -> Setup:
    data = ctx.copy(ctx.ctr, d / "data")
    _truncate(data / "train" / "part-00000.parquet")
    ctx.ctr_config(d, data)
    return Setup(["train", "cfg.yaml", "--out", "run"], protect=[data],
                 outputs=run_outputs(d / "run"))


def _gnn_indices(kind: str) -> Callable[[Ctx, Path], Setup]:
    def build(ctx: Ctx, d: Path) -> Setup:
        import numpy as np

        data = ctx.copy(ctx.graph, d / "data")
        path = data / "graph" / "indices.npy"
        if kind == "pickle":
            with open(path, "wb") as f:
                np.save(f, np.array([_Payload(marker(d))], dtype=object), allow_pickle=True)
        else:
            indices = np.load(path)
            indices[3] = json.loads((data / "metadata.json").read_text())["num_nodes"] + 5
            np.save(path, indices)
        write(d / "cfg.yaml", GNN_YAML.format(data=data))
        return Setup(["train", "cfg.yaml", "--out", "run"], protect=[data],
                     outputs=run_outputs(d / "run"))
    return build


def _seq_target(ctx: Ctx, d: Path) -> Setup:
    import pyarrow.parquet as pq

    data = ctx.copy(ctx.seq, d / "data")
    path = data / "train" / "part-00000.parquet"
    table = pq.read_table(path)
    targets = table.column("target").to_pylist()
    targets[3] = 1_000_000
    pq.write_table(set_column(table, "target", targets), path)
    write(d / "cfg.yaml", SEQ_YAML.format(data=data))
    return Setup(["train", "cfg.yaml", "--out", "run"], protect=[data],
                 outputs=run_outputs(d / "run"))


# --- acceptance checks -----------------------------------------------------------------------


def _exists(name: str) -> Callable[[Path], Optional[str]]:
    def check(d: Path) -> Optional[str]:
        return None if (d / name).exists() else f"exit 0 but no {name}"
    return check


CASES: list[Case] = [
    # configs ----------------------------------------------------------------------------------
    Case("config_alias_bomb", "config",
         _cfg(laughs(10, "data: {{path: /tmp/x, batch_size: 8}}\n"
                         "model: {{bottom_mlp: *l{depth}}}")),
         "refuse", ("cfg.yaml", "alias"), max_s=1.0),
    Case("config_duplicate_train_section", "config",
         _cfg("data: {path: /tmp/x}\ntrain: {max_steps: 5}\ntrain: {epochs: 2}\n"),
         "refuse", ("cfg.yaml", "duplicate", "train", "line 3")),
    Case("config_python_object_apply_tag", "config",
         _cfg("data:\n  path: !!python/object/apply:os.system ['touch MARKER_PATH']\n"),
         "refuse", ("cfg.yaml", "line 2")),
    Case("config_not_utf8", "config", _cfg("data: {path: /tmp/caf\u00e9}\n".encode("latin-1")),
         "refuse", ("cfg.yaml", "UTF-8")),
    Case("config_unknown_key", "config", _cfg("train:\n  batchsize: 3\n"), "refuse",
         ("cfg.yaml", "train.batchsize")),
    Case("config_wrong_type", "config", _cfg("train:\n  epochs: two\n"), "refuse",
         ("cfg.yaml", "train.epochs")),
    Case("config_empty_file", "config", _cfg(""), "refuse", ("cfg.yaml", "empty")),
    Case("config_deep_nesting", "config", _cfg("data: " + "[" * 20000 + "]" * 20000 + "\n"),
         "refuse", ("cfg.yaml",), max_s=2.0),
    Case("config_is_a_directory", "config", _cfg_dir, "refuse", ("configs_dir",)),
    Case("config_missing_data_path", "config",
         _cfg("data: {path: /nonexistent/dataset}\n"), "refuse", ("/nonexistent/dataset",)),
    Case("config_batch_size_1e12", "config", _cfg_set("data.batch_size=1000000000000"),
         "refuse", ("batch_size",)),
    Case("config_set_without_value", "config", _cfg_set("train.max_steps"), "refuse",
         ("train.max_steps",)),
    Case("config_nan_learning_rate", "config", _cfg_set("optim.dense_lr=.nan"), "refuse",
         ("optim.dense_lr",)),
    Case("plan_cluster_hosts_1000000", "config", _cluster_hosts, "refuse",
         ("cluster.yaml", "hosts"), max_s=2.0),
    Case("plan_hosts_sweep_1_to_100000", "config", _hosts_sweep, "refuse", ("--hosts",),
         max_s=2.0),
    # checkpoints and runs ---------------------------------------------------------------------
    Case("ckpt_pickle_metadata_eval", "checkpoint", _ckpt_pickle("eval"), "refuse",
         (".metadata",)),
    Case("ckpt_pickle_metadata_export", "checkpoint", _ckpt_pickle("export"), "refuse",
         (".metadata",)),
    Case("ckpt_pickle_metadata_resume", "checkpoint", _ckpt_pickle("resume"), "refuse",
         (".metadata",)),
    Case("ckpt_truncated_rank_file_resume", "checkpoint",
         _ckpt_edit(_truncate_rank, "resume", protect_always=False), "either",
         ("rank_00000.pt",), report=("rank_00000.pt", "older checkpoint")),
    Case("ckpt_missing_rank_file_resume", "checkpoint",
         _ckpt_edit(_drop_rank, "resume", protect_always=False), "accept",
         report=("rank_00000.pt", "older checkpoint")),
    Case("ckpt_truncated_distcp_eval", "checkpoint", _ckpt_edit(_truncate_distcp, "eval"),
         "refuse", ("__0_0.distcp",)),
    Case("ckpt_trainer_state_not_json_resume", "checkpoint",
         _ckpt_edit(_garbage_state, "resume"), "refuse", ("trainer_state.json",)),
    Case("run_without_config_eval", "checkpoint", _ckpt_edit(_drop_config, "eval"), "refuse",
         ("config.yaml",)),
    Case("train_over_a_finished_run", "checkpoint", _train_over_run, "refuse",
         ("myrun", "--resume")),
    Case("export_into_the_run_dir", "checkpoint", _export_into_run, "refuse", ("myrun",)),
    Case("eval_checkpoint_999", "checkpoint", _eval_args("--checkpoint", "999"), "refuse",
         ("999",)),
    Case("eval_unknown_split", "checkpoint", _eval_args("--split", "bogus"), "refuse",
         ("bogus",)),
    # exports and predict ----------------------------------------------------------------------
    Case("export_component_some_module_predict", "export", _component_module("some_module:M"),
         "accept", (), report=("written",), check=_exists("p.parquet")),
    Case("predict_truncated_dense_pt2", "export", _dense_program("truncated"), "refuse",
         ("dense.pt2",)),
    Case("predict_pickle_as_dense_pt2", "export", _dense_program("pickle"), "refuse",
         ("dense.pt2",)),
    Case("predict_pickled_object_table_npy", "export", _pickled_table, "refuse",
         ("t_C1.npy",)),
    Case("predict_export_without_model_json", "export", _no_model_json, "refuse",
         ("model.json",)),
    Case("predict_top_k_above_classes", "export", _topk, "refuse", ("--top-k", "20")),
    Case("predict_label_3", "export", _predict_label_3, "refuse",
         ("rows.parquet", "label", "row 7")),
    Case("predict_out_in_read_only_dir", "export", _readonly_out, "refuse", ("ro/p.parquet",)),
    Case("predict_out_is_its_input", "export", _out_is_input, "refuse", ("part-00000.parquet",)),
    Case("predict_batch_size_0", "export", _predict_args("--batch-size", "0"), "refuse",
         ("--batch-size",)),
    Case("predict_input_matches_nothing", "export", _predict_no_match, "refuse", ("nope",)),
    Case("export_over_an_export", "export", _export_over_export, "refuse", ("--overwrite",)),
    Case("export_quantize_int3", "export", _export_quantize, "refuse", ("int3",)),
    # ingest -----------------------------------------------------------------------------------
    Case("ingest_nan_in_dense", "ingest",
         _ingest("clicked,price,user_id\n1,1.5,a\n0,2,b\n1,NaN,a\n0,4,b\n"), "refuse",
         ("in.csv", "line 4", "price")),
    Case("ingest_list_in_single_valued", "ingest",
         _ingest("clicked\tprice\tuser_id\n1\t1\ta\n0\t2\tb\n1\t3\ta1,b2\n0\t4\tb\n", "in.tsv",
                 CSV_SPEC.replace("{format: csv}", '{format: csv, separator: "\\t"}')),
         "refuse", ("in.tsv", "line 4", "user_id")),
    Case("ingest_gzip_csv", "ingest", _ingest(gzip.compress(GOOD_CSV.encode())), "refuse",
         ("in.csv", "compressed")),
    Case("ingest_zero_byte_csv", "ingest", _ingest(b"", "empty.csv"), "refuse", ("empty.csv",)),
    Case("ingest_header_only_csv", "ingest", _ingest("clicked,price,user_id\n"), "refuse",
         ("in.csv",)),
    Case("ingest_not_utf8_byte", "ingest",
         _ingest(b"clicked,price,user_id\n1,1,a\n0,2,b\n1,3,\xffc\n"), "refuse",
         ("in.csv", "line 4", "UTF-8")),
    Case("ingest_column_named_twice", "ingest",
         _ingest("clicked,user_id,price,user_id\n1,a,1,b\n0,b,2,c\n"), "refuse",
         ("in.csv", "user_id", "twice")),
    Case("ingest_parquet_uint64_above_int64", "ingest", _ingest_uint64, "refuse",
         ("in.parquet", "user_id", "row 1")),
    Case("ingest_csv_id_beyond_int64", "ingest",
         _ingest("clicked,price,user_id\n1,1,1\n0,2,99999999999999999999\n1,3,2\n0,4,3\n"),
         "refuse", ("in.csv", "user_id", "line 3")),
    Case("ingest_all_empty_column", "ingest",
         _ingest("clicked,price,user_id\n1,1,\n0,2,\n1,3,\n0,4,\n"), "refuse",
         ("in.csv", "user_id")),
    Case("ingest_missing_label_column", "ingest", _ingest("price,user_id\n1,a\n2,b\n"),
         "refuse", ("in.csv", "clicked")),
    Case("ingest_ragged_row", "ingest",
         _ingest("clicked,price,user_id\n1,1,a\n0,2,b,extra\n1,3,c\n"), "refuse",
         ("in.csv", "line 3")),
    Case("ingest_label_3_counted", "ingest",
         _ingest("clicked,price,user_id\n1,1.5,a\n0,2,b\n3,1,a\n0,4,b\n"), "accept",
         report=("label_out_of_range 1",), check=_exists("out/metadata.json")),
    Case("ingest_spec_python_object_apply_tag", "ingest",
         _ingest(GOOD_CSV, spec="label: !!python/object/apply:os.system ['touch MARKER_PATH']\n"),
         "refuse", ("spec.yaml",)),
    Case("ingest_spec_alias_bomb", "ingest",
         _ingest(GOOD_CSV, spec=laughs(10, "input: {{format: csv}}\nlabel: clicked\n"
                                           "sparse: *l{depth}")),
         "refuse", ("spec.yaml", "alias"), max_s=2.0),
    Case("ingest_out_onto_a_run_dir", "ingest", _ingest_onto_run, "refuse", ("myrun",)),
    Case("ingest_graph_only_self_loops", "ingest",
         _ingest("src,dst\na,a\nb,b\nc,c\n", "edges.csv", GRAPH_SPEC), "refuse",
         ("edges.csv", "no edges")),
    Case("ingest_xc_label_out_of_range_counted", "ingest",
         _ingest("tokens,label\na b,0\na c,1\nb c,2\na b,7\n", "in.csv", XC_SPEC), "accept",
         report=("label_out_of_range 1",), check=_exists("out/metadata.json")),
    # training on a prepared data set ----------------------------------------------------------
    Case("train_multi_hot_50_ids_max_length_5", "train", _train_edit(_long_lists), "refuse",
         ("part-00000.parquet", "C24", "row 3")),
    Case("train_list_in_single_valued_C1", "train", _train_edit(_list_in_single), "refuse",
         ("part-00000.parquet", "C1", "row 3")),
    Case("train_num_embeddings_2_pow_70", "train", _train_meta, "refuse",
         ("metadata.json", "num_embeddings")),
    Case("train_id_equal_to_num_embeddings", "train", _train_edit(_id_at("C1", 15)), "refuse",
         ("part-00000.parquet", "C1", "row 3")),
    Case("train_negative_id", "train", _train_edit(_id_at("C2", -1)), "refuse",
         ("part-00000.parquet", "C2", "row 3")),
    Case("train_label_3", "train", _train_edit(_label_3), "refuse",
         ("part-00000.parquet", "label", "row 5")),
    Case("train_truncated_parquet", "train", _train_truncated_parquet, "refuse",
         ("part-00000.parquet",)),
    Case("train_missing_sparse_column", "train", _train_edit(_drop_c5), "refuse", ("C5",)),
    Case("train_gnn_pickled_indices_npy", "train", _gnn_indices("pickle"), "refuse",
         ("indices.npy",)),
    Case("train_gnn_neighbour_out_of_range", "train", _gnn_indices("range"), "refuse",
         ("indices.npy",)),
    Case("train_seq_target_out_of_range", "train", _seq_target, "refuse",
         ("part-00000.parquet", "target", "row 3")),
]


# ---------------------------------------------------------------- verdict predicates


def has_traceback(r: Result) -> bool:
    return "Traceback (most recent call last)" in r.stderr


def has_panic(r: Result) -> bool:
    return "panicked at" in r.stderr


def hung(r: Result) -> bool:
    return r.rc is None


ERROR_LINE = re.compile(r"^(embedtrain( [\w-]+)?: )?error: ")


def message_lines(r: Result) -> list[str]:
    """The error message: stderr from its first ``embedtrain CMD: error:`` line on, blank lines
    and progress redraws dropped; all of stderr when there is no such line."""
    lines = [x.strip() for x in r.stderr.replace("\r", "\n").splitlines() if x.strip()]
    for i, line in enumerate(lines):
        if ERROR_LINE.match(line):
            return lines[i:]
    return lines


def missing_names(text: str, must: tuple[str, ...]) -> list[str]:
    return [m for m in must if m not in text]


def tree_hashes(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (a path that is a file: itself), by path; a run's
    ``.lock`` aside (the writer lock: whoever takes it writes its PID there, by design)."""
    out: dict[str, str] = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            if f.name == ".lock":
                continue
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def verdict(case: Case, setup: Setup, r: Result, d: Path, before: dict, before_refusal: dict
            ) -> tuple[str, list[str]]:
    """(good | poor | bad, reasons)."""
    bad, poor = [], []
    refused = r.rc not in (0, None)
    if hung(r):
        bad.append(f"hang: no exit within {r.seconds:.0f} s")
    if has_traceback(r):
        bad.append("traceback")
    if has_panic(r):
        bad.append("Rust panic")
    if marker(d).exists():
        bad.append("code ran: the marker file appeared")
    diff = changed(before, tree_hashes([Path(p) for p in setup.protect] + [CTX.base]))
    if refused:
        diff += changed(before_refusal, tree_hashes(setup.protect_on_refusal))
    if diff:
        bad.append(f"read-only input or run changed: {_rel(diff[0])}"
                   + (f" (+{len(diff) - 1} more)" if len(diff) > 1 else ""))
    mode = case.expect if case.expect != "either" else ("refuse" if refused else "accept")
    if mode == "refuse":
        if r.rc == 0:
            bad.append("exit 0: accepted where it must be refused")
        elif refused:
            written = [o for o in setup.outputs if o.exists()]
            if written:
                bad.append(f"output written despite the refusal: {_rel(str(written[0]))}")
            lines = message_lines(r)
            if len(lines) != 1:
                poor.append(f"message of {len(lines)} lines")
            missing = missing_names("\n".join(lines), case.must)
            if missing:
                poor.append(f"message does not name {', '.join(map(repr, missing))}")
            if case.max_s is not None and r.seconds > case.max_s:
                poor.append(f"refused after {r.seconds:.1f} s (> {case.max_s} s)")
    elif not hung(r):
        if r.rc != 0:
            poor.append(f"refused (exit {r.rc}) where it should be accepted")
        else:
            missing = missing_names(r.stdout + r.stderr, case.report)
            if missing:
                poor.append(f"accepted without {', '.join(map(repr, missing))} in its output")
            reason = case.check(d) if case.check else None
            if reason:
                poor.append(reason)
    if bad:
        return "bad", bad + poor
    return ("poor", poor) if poor else ("good", [])


# ---------------------------------------------------------------- running


CTX: Ctx  # set in main


def _rel(path: str) -> str:
    return path.replace(str(CTX.work) + "/", "")


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_embedtrain(argv: list[str], cwd: Path, timeout: float) -> Result:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "embedtrain", *argv], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_limits)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the case's processes only
        out, err = proc.communicate()
        rc = None
    return Result(rc, out.decode(errors="replace"), err.decode(errors="replace"),
                  time.perf_counter() - start)


def run_case(case: Case, timeout: float) -> dict:
    d = CTX.work / "cases" / case.name
    d.mkdir(parents=True)
    setup = case.build(CTX, d)
    try:
        before = tree_hashes([Path(p) for p in setup.protect] + [CTX.base])
        before_refusal = tree_hashes(setup.protect_on_refusal)
        r = run_embedtrain(setup.argv, d, timeout)
        label, reasons = verdict(case, setup, r, d, before, before_refusal)
    finally:
        if setup.cleanup:
            setup.cleanup()
    lines = message_lines(r)
    first = [x for x in r.stderr.splitlines() if x.strip()]
    return {"name": case.name, "family": case.family,
            "command": "embedtrain " + _rel(shlex.join(setup.argv).replace(f"{d}/", "")),
            "expect": case.expect, "must": list(case.must), "max_s": case.max_s,
            "verdict": label, "reasons": reasons, "exit": r.rc, "seconds": round(r.seconds, 2),
            "message": _rel(lines[0].replace(f"{d}/", ""))[:500] if lines else "",
            "stderr_first_line": _rel(first[0].replace(f"{d}/", ""))[:500] if first else "",
            "stdout_last_line": (r.stdout.strip().splitlines() or [""])[-1][:500],
            "stderr_tail": r.stderr[-2000:]}


def build_fixtures(work: Path) -> None:
    """The shared data sets, runs and exports (one child process: torch imported once)."""
    code = subprocess.run([sys.executable, __file__, "--fixtures-child", str(work)],
                          capture_output=True, text=True)
    if code.returncode != 0:
        sys.exit(f"bad_inputs: building the fixtures failed:\n{code.stderr[-3000:]}")


def _fixtures_child(work: Path) -> None:
    import contextlib
    import io

    from embedtrain.cli import main
    from embedtrain.testing import (tiny_ctr_dataset, tiny_graph_dataset, tiny_seq_dataset,
                                    tiny_xc_dataset)
    from embedtrain.train import run_dir

    ctx = Ctx(work)
    tiny_ctr_dataset(ctx.ctr, rows=600)
    tiny_xc_dataset(ctx.xc, rows=600, classes=20)
    tiny_graph_dataset(ctx.graph, nodes=300)
    tiny_seq_dataset(ctx.seq, users=200, items=50)
    write(ctx.ctr_yaml, CTR_YAML.format(data=ctx.ctr))
    sets = [x for s in XC_SETS + [f"data.path={ctx.xc}"] for x in ("--set", s)]
    for argv in (["train", str(ctx.ctr_yaml), "--out", str(ctx.run)],
                 ["export", str(ctx.run), "--out", str(ctx.export), "--no-progress"],
                 ["train", str(ROOT / "configs/xc_synthetic.yaml"), "--out", str(ctx.xrun), *sets],
                 ["export", str(ctx.xrun), "--out", str(ctx.xexport), "--no-progress"]):
        held = set(run_dir._HELD)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
        for key in set(run_dir._HELD) - held:  # as the process's exit would
            run_dir.RunDir(key).unlock()
        if code != 0:
            sys.exit(f"{shlex.join(argv)}: exit {code}\n{err.getvalue()}")
    from embedtrain.processes import destroy_process_group

    destroy_process_group()


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<40} {'command':<58} {'verdict':<7} message (first line)")
    for row in rows:
        command = row["command"]
        command = command if len(command) <= 58 else command[:55] + "..."
        message = row["message"] or (f"(stdout) {row['stdout_last_line']}"
                                     if row["exit"] == 0 else "")
        print(f"{row['name']:<40} {command:<58} {row['verdict']:<7} {message[:MSG_CHARS]}")
        if row["reasons"]:
            print(f"{'':<40} {'':<58} {'':<7} -> {'; '.join(row['reasons'])}")


def main() -> None:
    global CTX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--keep", help="build in this directory and keep it (absent or empty)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    parser.add_argument("--fixtures-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fixtures_child:
        return _fixtures_child(Path(args.fixtures_child))

    cases = [c for c in CASES if not args.only or args.only in c.name]
    if not cases:
        parser.error(f"--only {args.only}: no case matches")
    if args.keep:
        work = Path(args.keep).resolve()
        if work.exists() and any(work.iterdir()):
            parser.error(f"--keep {work}: not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="embedtrain-bad-inputs-"))
    CTX = Ctx(work)
    started = time.perf_counter()
    rows = []
    try:
        build_fixtures(work)
        print(f"fixtures built in {time.perf_counter() - started:.0f} s; {len(cases)} cases",
              flush=True)
        for case in cases:
            rows.append(run_case(case, args.timeout))
            print(f"  {case.name}: {rows[-1]['verdict']} ({rows[-1]['seconds']:.1f} s)",
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    seconds = round(time.perf_counter() - started, 1)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("good", "poor", "bad")}
    print()
    print_table(rows)
    print(f"good {counts['good']}, poor {counts['poor']}, bad {counts['bad']} "
          f"({len(rows)} cases, {seconds:.0f} s)")
    report = {"counts": counts, "cases": rows, "seconds": seconds,
              "command": shlex.join(sys.orig_argv), "timeout_s": args.timeout,
              "python": sys.version.split()[0]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.json}; work directory: {work}{'' if args.keep else ' (removed)'}")


if __name__ == "__main__":
    main()
