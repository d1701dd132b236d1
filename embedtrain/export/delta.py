"""Delta exports: what changed between two exports of one line of runs, and the patch a server
applies to its served export in place, atomically.

``embedtrain export RUN --delta-from BASE --out DELTA`` (:func:`export_delta`) exports the run as
:func:`~embedtrain.export.export.export_run` would (same quantization and formats as ``BASE``),
then keeps only what differs from ``BASE`` (:func:`diff_exports`):

- a table file (``.npy``, float32 or int8/int4 rows) of the same width: the changed rows and the
  rows it grew by (a vocabulary extended), as ``rows/<file>.index.npy`` (row numbers, int32
  below 2^31 rows) and ``rows/<file>.values.npy``;
- a dynamic table's id map (``.ids.parquet``): the ids it no longer holds (evicted) and the
  ``(id, row)`` pairs it holds anew or elsewhere, ``ids/<file>.{removed,ids,rows}.npy``;
- any other file that differs (the dense program, ``model.json``, configs, vocabularies), whole,
  under ``files/``; files ``BASE`` has and the new export has not are listed as removed.

``delta.json`` records them with the SHA-256 of ``BASE``'s ``model.json`` (a delta applies to
that export only) and of every file the patch writes. Exports are reproducible (the same
checkpoint gives the same bytes: :func:`~embedtrain.export.export.export_run` seeds the example
inputs its program archives hold), so the patched export is byte for byte the full export of the
run's checkpoint.

``embedtrain export --apply DELTA --to EXPORT`` (:func:`apply_delta`) builds the patched export
beside ``EXPORT`` (unchanged files hard-linked, patched ones copied then patched), checks every
written file's SHA-256, then exchanges the two directories in one ``renameat2(RENAME_EXCHANGE)``
(Linux; elsewhere two renames) and removes the old one. Killed at any moment before the
exchange, ``EXPORT`` is untouched and the next apply removes the leftover; a reader loading the
export (:class:`~embedtrain.export.predict.ExportedModel`) sees the old files or the new ones,
never a mix (it reloads where ``model.json`` changed while it read).

Example:
    >>> export_run("runs/day1", "exports/live")
    >>> export_delta("runs/day2", "exports/live", "deltas/day2")["bytes_fraction_of_full"]
    0.18
    >>> apply_delta("deltas/day2", "exports/live")
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

from embedtrain.export.manifest import MANIFEST_FILE, ExportError, load_manifest
from embedtrain.export.tables import read_id_map, write_id_map
from embedtrain.utils import write_atomic

DELTA_FILE = "delta.json"
_ID_MAP = ".ids.parquet"
_BLOCK_BYTES = 64 << 20  # rows compared a block at a time


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def export_delta(run_dir: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike,
                 checkpoint: Optional[str] = None, progress: bool = True) -> dict[str, Any]:
    """The run's export as a delta against the export ``base`` (see the module docstring);
    returns ``delta.json``'s content."""
    from embedtrain.export.export import export_run

    base, out = Path(base), Path(out)
    m = load_manifest(base)
    formats = ["npy"] + (["parquet"] if any(t.files.parquet for t in m.tables) else [])
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        full = Path(tmp) / "export"
        export_run(run_dir, full, checkpoint, quantize=m.quantize, formats=formats,
                   progress=progress, aot=bool(m.dense_program and m.dense_program.aot),
                   index=m.items.index if m.items is not None else None)
        return diff_exports(base, full, out)


def diff_exports(base: Path, target: Path, out: Path) -> dict[str, Any]:
    """Writes the delta that turns export ``base`` into ``target`` to ``out`` (created)."""
    if out.exists():
        raise ExportError(f"{out}: exists; a delta is written to a new folder")
    old, new = _files(base), _files(target)
    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    record: dict[str, Any] = {
        "format_version": 1, "base": {"manifest_sha256": sha256(base / MANIFEST_FILE),
                                      "source": str(base.resolve())},
        "target": {"manifest_sha256": sha256(target / MANIFEST_FILE),
                   "source": load_manifest(target).source.checkpoint},
        "rows": [], "id_maps": [], "files": [], "removed": sorted(set(old) - set(new))}
    table_rows = changed_rows = 0
    for rel, path in new.items():
        entry = {"path": rel, "sha256": sha256(path)}
        if rel in old and old[rel].stat().st_size == path.stat().st_size \
                and sha256(old[rel]) == entry["sha256"]:
            if rel.endswith(".npy") and rel.startswith("tables/"):
                table_rows += np.load(path, mmap_mode="r").shape[0]
            continue
        if rel in old and rel.endswith(".npy"):
            index = _changed_rows(old[rel], path)
            if index is not None:
                values = np.load(path, mmap_mode="r")[index]
                _save(staging / "rows" / f"{rel}.index.npy", index)
                _save(staging / "rows" / f"{rel}.values.npy", values)
                record["rows"].append({**entry, "changed": len(index),
                                       "of": np.load(path, mmap_mode="r").shape[0]})
                if rel.startswith("tables/"):
                    table_rows += record["rows"][-1]["of"]
                    changed_rows += len(index)
                continue
        if rel in old and rel.endswith(_ID_MAP):
            removed, ids, rows = _id_map_changes(old[rel], path)
            for name, a in (("removed", removed), ("ids", ids), ("rows", rows)):
                _save(staging / "ids" / f"{rel}.{name}.npy", a)
            record["id_maps"].append({**entry, "removed": len(removed), "upserted": len(ids)})
            continue
        (staging / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, staging / "files" / rel)
        record["files"].append(entry)
    full = sum(p.stat().st_size for p in new.values())
    written = sum(p.stat().st_size for p in _files(staging).values())
    record.update(bytes=written, full_bytes=full, bytes_fraction_of_full=written / full,
                  table_rows=table_rows, rows_changed=changed_rows,
                  rows_changed_fraction=changed_rows / table_rows if table_rows else 0.0)
    write_atomic(staging / DELTA_FILE, json.dumps(record, indent=2) + "\n")
    os.replace(staging, out)
    return record


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.ascontiguousarray(array))


def _changed_rows(old_path: Path, new_path: Path) -> Optional[np.ndarray]:
    """The rows of the new array that differ (bitwise) from the old one's, rows it grew by
    included (a table grown for an extended vocabulary); None: not comparable."""
    a, b = np.load(old_path, mmap_mode="r"), np.load(new_path, mmap_mode="r")
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype or a.ndim < 1 or not a.shape[0] \
            or b.shape[0] < a.shape[0]:
        return None
    width = max(1, a.nbytes // a.shape[0])
    block = max(1, _BLOCK_BYTES // width)
    changed = []
    for lo in range(0, a.shape[0], block):
        x = np.ascontiguousarray(a[lo:lo + block]).view(np.uint8).reshape(-1, width)
        y = np.ascontiguousarray(b[lo:min(lo + block, a.shape[0])]).view(np.uint8) \
            .reshape(-1, width)
        changed.append(lo + np.flatnonzero((x != y).any(axis=1)))
    changed.append(np.arange(a.shape[0], b.shape[0]))
    return np.concatenate(changed).astype(np.int32 if b.shape[0] < 2**31 else np.int64)


def _id_map_changes(old_path: Path, new_path: Path
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids removed, ids held anew or elsewhere, their rows)`` between two id maps."""
    old_ids, old_rows = (t.numpy() for t in read_id_map(old_path, 2**62))
    new_ids, new_rows = (t.numpy() for t in read_id_map(new_path, 2**62))
    removed = np.setdiff1d(old_ids, new_ids, assume_unique=True)
    at = np.searchsorted(old_ids, new_ids).clip(max=max(len(old_ids) - 1, 0))
    same = (old_ids[at] == new_ids) & (old_rows[at] == new_rows) if len(old_ids) else \
        np.zeros(len(new_ids), dtype=bool)
    rows = new_rows[~same]
    return removed, new_ids[~same], rows.astype(np.int32) if len(rows) and rows.max() < 2**31 \
        else rows


def apply_delta(delta: str | os.PathLike, export: str | os.PathLike) -> dict[str, Any]:
    """Patches the served ``export`` with ``delta`` (see the module docstring); returns
    ``delta.json``'s content. An export the delta was already applied to is left as it is.

    Raises:
        ExportError: not a delta, or one made from another export (one line).
    """
    delta, export = Path(delta), Path(export)
    try:
        record = json.loads((delta / DELTA_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{delta / DELTA_FILE}: not a delta export: {e}") from None
    current = sha256(export / MANIFEST_FILE) if (export / MANIFEST_FILE).is_file() else None
    if current == record["target"]["manifest_sha256"]:
        return record  # applied already (e.g. a retry after the exchange)
    if current != record["base"]["manifest_sha256"]:
        raise ExportError(f"{delta}: made from the export {record['base']['source']}, whose "
                          f"model.json {export / MANIFEST_FILE} is not (SHA-256 differs)")
    staging = export.with_name(f".{export.name}.apply")
    shutil.rmtree(staging, ignore_errors=True)  # what a killed apply left
    patched = {e["path"] for kind in ("rows", "id_maps", "files") for e in record[kind]}
    skip = patched | set(record["removed"])
    for rel, path in _files(export).items():
        if rel not in skip:
            _link(path, staging / rel)
    for e in record["rows"]:
        target = staging / e["path"]
        _copy_rows(export / e["path"], target, e["of"])
        array = np.load(target, mmap_mode="r+")
        array[np.load(delta / "rows" / f"{e['path']}.index.npy")] = \
            np.load(delta / "rows" / f"{e['path']}.values.npy")
        array.flush()
        del array
    for e in record["id_maps"]:
        _patch_id_map(export / e["path"], delta / "ids" / e["path"], staging / e["path"])
    for e in record["files"]:
        _copy(delta / "files" / e["path"], staging / e["path"])
    for kind in ("rows", "id_maps", "files"):
        for e in record[kind]:
            _fsync(staging / e["path"])  # on disk before the exchange publishes it
            if sha256(staging / e["path"]) != e["sha256"]:
                shutil.rmtree(staging, ignore_errors=True)
                raise ExportError(f"{delta}: patching {export / e['path']} did not give the "
                                  f"delta's file (SHA-256 differs); the export is unchanged")
    _exchange(staging, export)
    shutil.rmtree(staging, ignore_errors=True)  # the old export
    return record


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def _copy_rows(source: Path, target: Path, rows: int) -> None:
    """``source`` copied to ``target``, grown to ``rows`` rows (the new ones zero)."""
    old = np.load(source, mmap_mode="r")
    if old.shape[0] == rows:
        _copy(source, target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    new = np.lib.format.open_memmap(target, mode="w+", dtype=old.dtype,
                                    shape=(rows, *old.shape[1:]))
    block = max(1, _BLOCK_BYTES // max(1, old.nbytes // max(old.shape[0], 1)))
    for lo in range(0, old.shape[0], block):
        hi = min(lo + block, old.shape[0])
        new[lo:hi] = old[lo:hi]
    new.flush()
    del new


def _patch_id_map(old: Path, changes: Path, target: Path) -> None:
    ids, rows = (t.numpy() for t in read_id_map(old, 2**62))
    removed = np.load(f"{changes}.removed.npy")
    new_ids = np.load(f"{changes}.ids.npy")
    new_rows = np.load(f"{changes}.rows.npy").astype(np.int64)
    keep = ~np.isin(ids, removed) & ~np.isin(ids, new_ids)
    ids, rows = np.concatenate([ids[keep], new_ids]), np.concatenate([rows[keep], new_rows])
    order = np.argsort(ids, kind="stable")
    target.parent.mkdir(parents=True, exist_ok=True)
    import torch

    write_id_map(target, torch.from_numpy(ids[order]), torch.from_numpy(rows[order]))


def _exchange(a: Path, b: Path) -> None:
    """Swaps directories ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``), or with two
    renames where the system has no exchange."""
    for d in (a, b.parent):
        _fsync(d)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))
    except AttributeError:  # no renameat2 in this C library
        pass
    aside = b.with_name(f".{b.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)
