"""``embedtrain export``: a run's checkpoint as files an inference job loads without embedtrain's
training stack: embedding tables, the XC class head, the dense model, and ``model.json``.

What is written where is in :mod:`embedtrain.export.manifest`. This module knows no task
family: the run's recipe (:func:`embedtrain.recipes.recipe_for` of its ``config.yaml``) says
what is particular to one -- :meth:`~embedtrain.recipes.base.Recipe.export_refusal` (what it
cannot export) and :meth:`~embedtrain.recipes.base.Recipe.export_parts`
(:class:`~embedtrain.recipes.export_parts.ExportParts`: the model's name, the rows' features, the dense
program, a class head, a note). How:

1. The recipe builds the model on the ``meta`` device (no memory): that names every table, its
   checkpoint key, rows, dimension and pooling (:func:`model_tables`).
2. The dense model the recipe gives (DLRM/DCNv2: bottom MLP, interaction, top MLP; XC: the
   encoder's MLP; GNN: none), on CPU, has its parameters loaded with
   ``torch.distributed.checkpoint.load`` (no process group) and is exported with
   ``torch.export`` (``torch.export.save``; TorchScript where export fails), its batch
   dimension dynamic; the program is checked against the module. With ``aot`` (``--aot``) the
   written program is also compiled by AOTInductor into ``dense.aoti.pt2``
   (``torch._inductor.aoti_compile_and_package``: C++ kernels and the weights in one package
   that ``torch._inductor.aoti_load_package`` runs without Python model code; tens of seconds
   with a C++ compiler), checked against the module on the example and on a batch of 1 row.
3. Tables (and a sharded class head) are read from the DCP checkpoint one tensor at a time and,
   within it, one shard at a time (:func:`~embedtrain.export.tables.stream_tensor`), straight
   into their ``.npy`` files: a checkpoint of N ranks, row-wise, table-wise or column-wise,
   exports on one process, and the memory it takes is at most one shard (one table for a
   1-rank checkpoint) over the process's baseline (:attr:`ExportResult.peak_over_baseline`).
   Parquet copies and quantized rows are made from the ``.npy`` in row blocks. Tables are
   written as float32; the class head in the dtype it was saved in (the checkpoint's metadata
   says): float32, or bfloat16 (``head.dtype: bf16``) as ``uint16`` bit patterns, shard by
   shard, never widened to float32 (a 50M x 128 head is 12.8 GB, not 25.6); its parquet copy
   (``npy,parquet``) is float32 lists, widened one row block at a time. ``--quantize`` applies
   to the tables only: the head stays as it was trained.
4. Dynamic tables (:mod:`embedtrain.tables.dynamic`) also get their id -> row map,
   ``tables/<table>.ids.parquet``, read from the remapper's checkpointed buffers; serving maps
   an id as training's evaluation does (details: :mod:`embedtrain.export.manifest`).
5. Vocabularies, the run's config and the data set's ``metadata.json`` are copied;
   ``model.json`` says what each file is and what preprocessing rows need.

Tables are listed in the model's own feature order: the order the dense program's ``pooled``
input takes them in.

GNN runs export their node table (if any) and every node's outputs by layer-wise full-graph
inference with the run's layers over the node table just written, before it is converted
(:class:`~embedtrain.recipes.export_parts.NodeOutputsExport`, ``model.json``'s ``nodes``); no
dense program. XC runs need a sharded head; sequence runs export their item table (looked up per
position: float32 only), the encoder's blocks as the dense program and the item head. Retrieval
runs export the query tower as the dense program and the item side
(:class:`~embedtrain.recipes.export_parts.ItemsExport`): every item embedded by the item tower
over the item tables just written, its program, the item table and a FAISS index
(:mod:`embedtrain.export.items`, ``model.json``'s ``items``).

Example:
    >>> result = export_run("runs/demo", "exports/demo", quantize="int8")
    >>> result.manifest.float32_bytes / result.manifest.table_bytes
    3.2
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from embedtrain.config import load_run_config, task_family
from embedtrain.export.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    QUANTIZE,
    DenseFeature,
    DensePreprocessing,
    DenseProgram,
    ExportError,
    Features,
    Head,
    Manifest,
    NodeArray,
    NodeOutputs,
    Shard,
    Source,
    SparseFeature,
    Table,
    TableFiles,
    write_manifest,
)
from embedtrain.export.tables import (
    NPY_DTYPES,
    ROWS_OF_IDS,
    SORTED_IDS,
    TORCH_DTYPES,
    NpyWriter,
    checkpoint_dtypes,
    checkpoint_id_map,
    checkpoint_tensors,
    quantize_npy,
    stream_tensor,
    write_id_map,
    write_parquet,
)
from embedtrain.export.items import export_item_side, optional_index
from embedtrain.export.programs import (
    TableSpec,
    aot_package,
    export_program,
    load_module,
    model_tables,
)
from embedtrain.tables.dynamic import MIX_VERSION
from embedtrain.heads.low_precision import DTYPES
from embedtrain.recipes import recipe_for
from embedtrain.recipes.base import DatasetInfo
from embedtrain.recipes.export_parts import (
    DenseExport,
    ExportParts,
    HeadExport,
    NodeOutputsExport,
)
from embedtrain.train.checkpoint import CheckpointError, CheckpointManager
from embedtrain.train.run_dir import RunDir
from embedtrain.utils import progress_bar, stop_on_signals, writing

FORMATS = ("npy", "parquet")


@dataclass
class ExportResult:
    """What :func:`export_run` wrote and what it took.

    Attributes:
        out: the export directory.
        manifest: its ``model.json``.
        seconds: wall time.
        baseline_rss: resident bytes of the process just before the tables are read: torch
            and TorchRec imported, the config read, the model built on ``meta``, the (small)
            dense model exported.
        peak_rss: the highest resident bytes while the tables (and the head) are read,
            written, converted to parquet and quantized, and a GNN's per-node outputs computed
            (``VmHWM``, reset to the baseline before them); None where Linux's
            ``/proc/self/clear_refs`` cannot reset it.
        largest_table: bytes of the largest tensor exported, as written (a float32 table, or
            the class head in its dtype).
    """

    out: Path
    manifest: Manifest
    seconds: float
    baseline_rss: int
    peak_rss: Optional[int]
    largest_table: int
    chosen: str = ""  # why this checkpoint (the summary's step, the newest, the one asked for)

    @property
    def peak_over_baseline(self) -> Optional[int]:
        """Peak resident bytes of the tables' phase over the baseline (None: not measured)."""
        return None if self.peak_rss is None else max(0, self.peak_rss - self.baseline_rss)


@dataclass
class _Tensor:
    """A float tensor of the checkpoint to write as files."""

    key: str
    shape: tuple[int, int]
    stem: Path  # out / "tables" / name, without suffix
    dtype: str = "float32"  # as written: float32 | bfloat16 (NPY_DTYPES)


def export_run(run_dir: str | Path, out: str | Path, checkpoint: Optional[str] = None,
               quantize: str = "none", formats: Sequence[str] = ("npy",),
               overwrite: bool = False, progress: bool = True, aot: bool = False,
               index: Optional[str] = None) -> ExportResult:
    """Exports a run's checkpoint (see the module docstring).

    Args:
        run_dir: a run directory written by ``embedtrain train``.
        out: the export directory (created; an earlier export there needs ``overwrite``).
        checkpoint: a step (``500``, ``step_00000500``) or a checkpoint directory; default:
            the step the run's ``summary.json`` reports (``selected.step``: the best validation
            step with ``train.select: best``), the model the run's figures describe; a run
            without a summary (unfinished): its newest complete checkpoint.
        quantize: ``none`` (float32 tables), ``int8`` or ``int4`` (FBGEMM's rowwise fused rows,
            through TorchRec's quantizer); the class head stays as trained (float32 or
            bfloat16).
        formats: table files: ``npy`` and/or ``parquet`` (float32 tables only; a bfloat16 class
            head needs ``npy``).
        overwrite: replace an earlier export in ``out``.
        progress: show a progress bar (rows of the tables), and say when AOTInductor compiles.
        aot: also compile the dense program with AOTInductor (:data:`~embedtrain.export.programs.AOT_FILE`; a
            ``torch.export`` program only).
        index: retrieval: the item index, ``auto`` (the default: exact ``flat`` up to
            :data:`~embedtrain.export.items.AUTO_FLAT_MAX` items, ``hnsw`` above), ``flat``,
            ``hnsw`` or ``ivf`` (:mod:`embedtrain.export.items`).

    Raises:
        ExportError: bad arguments, not a run directory, a model that cannot be exported
            (``aot``: without a ``torch.export`` program, or a package that does not reproduce
            the model).
        CheckpointError: no checkpoint, or one that cannot be read (named).
    """
    start = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    formats = _check_options(quantize, formats)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_run_config(run_dir / "config.yaml")
    recipe = recipe_for(cfg)
    refusal = recipe.export_refusal()  # before any file is touched
    if refusal:
        raise ExportError(refusal)
    model = recipe.planning_model()  # on meta: no table memory
    tables = model_tables(model)
    per_position = [t.name for t in tables if t.pooling == "none"]
    if quantize != "none" and per_position:
        raise ExportError(f"--quantize {quantize}: {per_position[0]} is looked up per position "
                          f"(a sequence's items), which the quantized kernels do not do; export "
                          f"it as float32 (--quantize none)")
    # seeded example inputs (saved in the program's archive): two exports of one checkpoint are
    # the same bytes (embedtrain.export.delta relies on it)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        parts = recipe.export_parts(model, [(t.name, t.rows, t.dim) for t in tables])
    if index is not None and parts.items is None:
        raise ExportError(f"--index: a {parts.model} export has no item index (retrieval only)")
    if parts.items is not None and quantize != "none":
        raise ExportError(f"--quantize {quantize}: a retrieval export's item embeddings are "
                          f"computed from its float tables; export it as float32 "
                          f"(--quantize none)")
    index = optional_index(index)
    if aot and parts.dense is None:
        raise ExportError(f"--aot: a {parts.model} export has no dense program to compile "
                          f"({parts.note or 'none'}); export without --aot")
    manager = CheckpointManager(run_dir / "checkpoints")
    chosen = "the checkpoint asked for (--checkpoint)"
    if checkpoint is None:  # the model the run's summary describes
        checkpoint, chosen = RunDir(run_dir).selected_step()
        if checkpoint is not None and not manager.path(checkpoint).is_dir():
            raise CheckpointError(f"{manager.path(checkpoint)}: summary.json reports step "
                                  f"{checkpoint:,}, whose checkpoint is gone; name one with "
                                  f"--checkpoint")
    if checkpoint is None and manager.latest() is None:
        raise CheckpointError(f"{run_dir / 'checkpoints'}: no complete checkpoint to export")
    # Pinned while it is read: a training run's pruning passes over it.
    with manager.reading(manager.find(checkpoint) if checkpoint is not None else None) as ckpt, \
            torch.random.fork_rng():
        torch.manual_seed(0)  # the item side's example inputs
        result = _export_checkpoint(cfg, recipe, parts, tables, run_dir, out, ckpt,
                                    manager.info(ckpt), quantize, formats, progress, overwrite,
                                    start, aot, index)
    result.chosen = chosen
    return result


def _export_checkpoint(cfg, recipe, parts: ExportParts, tables: list[TableSpec],
                       run_dir: Path, out: Path, ckpt: Path, info: dict[str, Any], quantize: str,
                       formats: Sequence[str], progress: bool, overwrite: bool,
                       start: float, aot: bool, index: str = "auto") -> ExportResult:
    saved = checkpoint_tensors(ckpt)
    h = parts.head
    remapped = [(f"{t.remap}.{b}", (t.rows,)) for t in tables if t.remap
                for b in (SORTED_IDS, ROWS_OF_IDS)]
    for key, shape in ([(t.key, (t.rows, t.dim)) for t in tables]
                       + ([(h.checkpoint_key, (h.num_classes, h.dim))] if h else []) + remapped):
        if key not in saved:
            raise CheckpointError(f"{ckpt}: has no {key}; was it written by this run's model?")
        if tuple(saved[key]) != tuple(shape):
            raise CheckpointError(f"{ckpt}: {key} is {list(saved[key])}, the run's config makes "
                                  f"it {list(shape)}; was it written by this run's model?")
    head_dtype = _head_dtype(ckpt, h, formats) if h else "float32"
    _prepare_out(out, overwrite)
    # a SIGTERM or SIGINT raises Stopped: the export is removed as after an error
    with stop_on_signals(out):
        try:
            with writing(out):  # a write error naming no file names the export
                return _export(task_family(cfg).value, recipe.dataset_info(), parts, tables, run_dir,
                               out, ckpt, info, quantize, formats, progress, start, aot,
                               head_dtype, index)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)  # no half-written export is left behind
            raise


def _export(task: str, data: DatasetInfo, parts: ExportParts, tables: list[TableSpec],
            run_dir: Path, out: Path, ckpt: Path, info: dict[str, Any], quantize: str,
            formats: Sequence[str], progress: bool, start: float, aot: bool,
            head_dtype: str, index: str = "auto") -> ExportResult:
    # 1. The dense model (small; it also loads what reading a checkpoint needs, so that the
    # baseline below holds every library the tables' phase uses).
    program = _dense_program(parts.dense, ckpt, out, aot, progress)

    # 2. The tables, one tensor and one shard at a time (the memory-bound phase).
    (out / "tables").mkdir()
    todo = [_Tensor(t.key, (t.rows, t.dim), out / "tables" / t.name) for t in tables]
    h, meta_root = parts.head, data.meta_root or data.root  # metadata, vocabularies: here
    if h:
        (out / "head").mkdir()
        todo.append(_Tensor(h.checkpoint_key, (h.num_classes, h.dim), out / "head" / "weight",
                            head_dtype))
    baseline, can_reset = _reset_peak_rss()
    entries: list[Table] = []
    head_entry = node_entry = None
    nodes = parts.nodes
    with progress_bar(sum(t.shape[0] for t in todo), "export", disable=not progress) as bar:
        for i, t in enumerate(todo):
            with NpyWriter(t.stem.with_suffix(".npy"), t.shape, t.dtype) as writer:
                shards = stream_tensor(ckpt, t.key, t.shape, writer.write)
            if i < len(tables):
                if nodes is not None and tables[i].name == nodes.table:
                    # from the float table as written, before it is converted
                    node_entry = _node_outputs(nodes, ckpt, out, tables[i], progress)
                entries.append(_table_entry(tables[i], shards, out, quantize, formats))
                if tables[i].remap:
                    _add_id_map(entries[-1], tables[i], ckpt, out)
            else:
                head_entry = _head_entry(h, shards, meta_root, out, formats, t.dtype)
            bar.update(t.shape[0])
    if nodes is not None and node_entry is None:  # a model without a node table
        node_entry = _node_outputs(nodes, ckpt, out, None, progress)
    items_entry = None
    if parts.items is not None:  # retrieval: every item embedded, then indexed
        head_entry, items_entry = export_item_side(parts.items, ckpt, out, index, progress)
    peak = _peak_rss() if can_reset else None

    # 3. Vocabularies, config, data set metadata, model.json.
    features = _features(parts, tables, meta_root, out)
    for table in entries:
        table.vocab = next((f.vocab for f in features.sparse if f.table == table.name), None)
    for source, target in ((run_dir / "config.yaml", out / "config.yaml"),
                           (meta_root / "metadata.json", out / "dataset_metadata.json")):
        with writing(target):  # a full disk names the copy, not its source
            shutil.copyfile(source, target)
    manifest = Manifest(
        format_version=FORMAT_VERSION, task=task, model=parts.model, quantize=quantize,
        features=features, tables=entries, source=Source(
            run_dir=str(run_dir.resolve()), checkpoint=str(Path(ckpt).resolve()),
            step=int(info["step"]), world_size=int(info.get("world_size", 1)),
            dataset=str(data.root), dataset_name=data.name),
        dense_program=program, head=head_entry, note=parts.note, nodes=node_entry,
        score=parts.score, items=items_entry)
    with writing(out / MANIFEST_FILE):
        write_manifest(manifest, out)
    largest = max((t.shape[0] * t.shape[1] * NPY_DTYPES[t.dtype].itemsize for t in todo),
                  default=0)
    return ExportResult(out, manifest, time.perf_counter() - start, baseline, peak, largest)


def _check_options(quantize: str, formats: Sequence[str]) -> list[str]:
    if quantize not in QUANTIZE:
        raise ExportError(f"--quantize: {quantize!r} is not one of {', '.join(QUANTIZE)}")
    formats = [f.strip() for f in formats if f.strip()]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ExportError(f"--format: unknown {', '.join(unknown) or '(empty)'} "
                          f"(use npy, parquet or npy,parquet)")
    if quantize != "none" and "parquet" in formats:
        raise ExportError(f"--format parquet: parquet tables are float32; with --quantize "
                          f"{quantize} use --format npy (fused {quantize} rows)")
    return formats


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MANIFEST_FILE).is_file():
            raise ExportError(f"{out}: not empty and not an export; choose another --out")
        if not overwrite:
            raise ExportError(f"{out}: holds an export; pass --overwrite to replace it, or "
                              f"choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _table_entry(t: TableSpec, shards: list[Shard], out: Path, quantize: str,
                 formats: Sequence[str]) -> Table:
    """Makes the requested files of one written float table and describes them."""
    npy = out / "tables" / f"{t.name}.npy"
    files = TableFiles()
    if "parquet" in formats:
        write_parquet(npy, npy.with_suffix(".parquet"))
        files.parquet = f"tables/{t.name}.parquet"
    float_bytes = t.rows * t.dim * 4
    size = float_bytes
    if quantize != "none":
        quantized = out / "tables" / f"{t.name}.{quantize}.npy"
        size = quantize_npy(npy, quantized, quantize)
        npy.unlink()
        files.npy = f"tables/{quantized.name}"
    elif "npy" in formats:
        files.npy = f"tables/{t.name}.npy"
    else:
        npy.unlink()
        size = (out / files.parquet).stat().st_size
    return Table(name=t.name, features=list(t.features), rows=t.rows, dim=t.dim,
                 pooling=t.pooling, dtype="float32" if quantize == "none" else quantize,
                 files=files, bytes=size, float32_bytes=float_bytes, checkpoint_key=t.key,
                 shards=shards)


def _add_id_map(entry: Table, t: TableSpec, ckpt: Path, out: Path) -> None:
    """Writes a dynamic table's id -> row map and records it (with the default rows)."""
    ids, rows, segments = checkpoint_id_map(ckpt, t.remap, t.rows)
    write_id_map(out / "tables" / f"{t.name}.ids.parquet", ids, rows)
    entry.id_map = f"tables/{t.name}.ids.parquet"
    entry.segments = segments
    entry.default_rows = [end - 1 for end in segments[1:]]
    entry.ids_held = int(ids.numel())
    entry.id_mix = MIX_VERSION


def _reset_peak_rss() -> tuple[int, bool]:
    """Current resident bytes, and whether the peak (``VmHWM``) was reset to it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    return _status("VmRSS") or 0, reset


def _peak_rss() -> Optional[int]:
    return _status("VmHWM")


def _status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _dense_program(dense: Optional[DenseExport], ckpt: Path, out: Path, aot: bool = False,
                   progress: bool = False) -> Optional[DenseProgram]:
    """Loads the dense parameters from the checkpoint and exports the program (and, with
    ``aot``, its AOTInductor package)."""
    if dense is None:
        return None
    module = load_module(ckpt, dense.module, dense.checkpoint_prefix)
    file, kind = export_program(module, dense.example, out)
    if aot and kind != "torch.export":
        raise ExportError(f"--aot: torch.export could not trace the dense model (it was written "
                          f"as TorchScript, {file}); AOTInductor compiles torch.export programs "
                          f"only: export without --aot")
    return DenseProgram(file=file, format=kind, inputs=dense.inputs, output=dense.output,
                        parameters=sum(p.numel() for p in module.parameters()),
                        aot=aot_package(module, dense.example, out, progress) if aot else None)


def _node_outputs(nodes: NodeOutputsExport, ckpt: Path, out: Path,
                  table: Optional[TableSpec], progress: bool) -> NodeOutputs:
    """Loads the layers from the checkpoint and computes every node's outputs into
    ``out/nodes/<name>.npy`` over the node table written at ``out/tables`` (its id map, for a
    dynamic table, read from the checkpoint); copies the data set's node ids."""
    # the layers' parameters; the tables (on meta) are read from their exported file
    module = load_module(ckpt, nodes.module, nodes.checkpoint_prefix)
    lookup = None
    if table is not None:
        lookup = _table_lookup(out / "tables" / f"{table.name}.npy", table, ckpt)
    (out / "nodes").mkdir()
    files = {name: out / "nodes" / f"{name}.npy" for name in nodes.arrays}
    nodes.compute(module, lookup, files, progress)
    arrays = []
    for name, what in nodes.arrays.items():
        rows, dim = np.load(files[name], mmap_mode="r").shape
        arrays.append(NodeArray(name, f"nodes/{name}.npy", int(rows), int(dim), what))
    ids = None
    if nodes.ids is not None:
        with writing(out / "nodes" / "ids.parquet"):
            shutil.copyfile(nodes.ids, out / "nodes" / "ids.parquet")
        ids = "nodes/ids.parquet"
    return NodeOutputs(num_nodes=arrays[0].rows, output=arrays[0].name, arrays=arrays, ids=ids)


def _table_lookup(npy: Path, table: TableSpec, ckpt: Path):
    """ids -> rows of an exported float table (memory-mapped); a dynamic table's ids through
    its id map, as predict and evaluation map them."""
    from embedtrain.export.predict import IdMap

    weights = np.load(npy, mmap_mode="r")
    id_map = None
    if table.remap:
        id_map = IdMap(*checkpoint_id_map(ckpt, table.remap, table.rows))

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        rows = ids if id_map is None else id_map.rows(ids)
        return torch.from_numpy(np.asarray(weights[rows.numpy()]))

    return lookup


def _head_dtype(ckpt: Path, h: HeadExport, formats: Sequence[str]) -> str:
    """The dtype the class head was saved in (``float32``, ``bfloat16`` or ``float8_e4m3fn``),
    from the checkpoint's metadata; a low-precision head needs its ``.npy`` (parquet holds
    float32)."""
    saved = checkpoint_dtypes(ckpt)[h.checkpoint_key]
    dtype = next((name for name, d in TORCH_DTYPES.items() if d == saved), None)
    if dtype is None:
        raise CheckpointError(f"{ckpt}: {h.checkpoint_key} is {saved}; export writes float32, "
                              f"bfloat16 or float8_e4m3fn class heads")
    if dtype != "float32" and "npy" not in formats:
        setting = next(k.value for k, d in DTYPES.items() if d == saved)  # head.dtype
        raise ExportError(f"--format parquet: the class head is {dtype} (head.dtype: "
                          f"{setting}), kept as such in its .npy (parquet holds float32 lists); "
                          f"use --format npy,parquet")
    return dtype


def _head_entry(h: HeadExport, shards: list[Shard], root: Path, out: Path,
                formats: Sequence[str], dtype: str) -> Head:
    """Makes the requested files of the written class head and describes them."""
    npy = out / "head" / "weight.npy"
    files = TableFiles(npy="head/weight.npy")
    if "parquet" in formats:
        write_parquet(npy, npy.with_suffix(".parquet"))
        files.parquet = "head/weight.parquet"
    if "npy" not in formats:
        npy.unlink()
        files.npy = None
    return Head(kind=h.kind, num_classes=h.num_classes, dim=h.dim, files=files,
                bytes=h.num_classes * h.dim * NPY_DTYPES[dtype].itemsize,
                checkpoint_key=h.checkpoint_key, normalised=h.normalised, scale=h.scale,
                top_k=list(h.top_k), shards=shards,
                vocab=_copy_vocab(root, h.vocab, out) if h.vocab else None, dtype=dtype)


def _features(parts: ExportParts, tables: list[TableSpec], root: Path, out: Path) -> Features:
    """The rows' columns and what ingestion did to them; vocabularies copied from ``root``."""
    spec, extra = parts.features, parts.ingest
    table_of: dict[str, str] = {}  # a feature's table: its embedding's (not its first-order)
    for t in tables:
        for f in t.features:
            table_of.setdefault(f, t.name)
    stats = extra.get("dense_stats") or {}
    casts = {d.get("name"): d.get("cast") for d in (extra.get("spec") or {}).get("dense", [])
             if isinstance(d, dict)}
    transform = spec.dense_transform.value
    dense = []
    for name in spec.dense:
        s = stats.get(name)
        ingest = None
        if isinstance(s, dict):
            ingest = DensePreprocessing(
                fill_null=float(s.get("fill_null") or 0.0), cast=casts.get(name),
                clip_min=s.get("clip_min"), clip_max=s.get("clip_max"),
                log1p=bool(s.get("log1p")), standardize=bool(s.get("standardized")),
                mean=s.get("mean"), std=s.get("std"))
        dense.append(DenseFeature(name, transform, ingest))
    vocab_files = extra.get("vocab_files") or {}
    hashes = extra.get("hash_buckets") or {}
    buckets = extra.get("bucket_boundaries") or {}
    sparse_spec = {d.get("name"): d for d in (extra.get("spec") or {}).get("sparse", [])
                   if isinstance(d, dict)}
    sparse = []
    for f in spec.sparse:
        entry = SparseFeature(f.name, table_of.get(f.name, ""), f.num_embeddings, f.multi_hot,
                              f.max_length)
        given = sparse_spec.get(f.name, {})
        entry.column = given.get("column")
        if f.raw:
            entry.encoding = "raw"  # raw int64 ids: its dynamic table's id map finds rows
        elif f.name in vocab_files:
            entry.encoding, entry.vocab = "vocab", _copy_vocab(root, vocab_files[f.name], out)
            entry.min_frequency = given.get("min_frequency")
        elif f.name in hashes:
            entry.encoding, entry.hash_buckets = "hash", int(hashes[f.name])
        elif f.name in buckets:
            entry.encoding = "quantiles" if given.get("quantiles") else "bucketize"
            entry.bucket_boundaries = [float(b) for b in buckets[f.name]]
        if entry.encoding not in ("pre_encoded", "raw") and "null_id" in extra:
            entry.null_id = int(extra["null_id"])
        sparse.append(entry)
    return Features(spec.label, dense, sparse, spec.num_classes, spec.max_labels)


def _copy_vocab(root: Path, relative: str, out: Path) -> Optional[str]:
    source = root / relative
    if not source.is_file():
        return None
    target = out / "vocab" / source.name
    target.parent.mkdir(exist_ok=True)
    with writing(target):
        shutil.copyfile(source, target)
    return f"vocab/{source.name}"
