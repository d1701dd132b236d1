"""The synthetic CTR data set as raw Criteo-style TSV: what ``embedtrain ingest`` starts from.

The rows are exactly those of :func:`embedtrain.datagen.ctr.generate_ctr` with the same spec, in
generation order and unsplit (raw logs do not come split). Each line holds, tab-separated and with
no header: the 0/1 label, the 13 integer counts ``I1..I13``, and the 26 categorical features
``C1..C26`` as 8-hex-digit tokens, like the Criteo release. The multi-hot features ``C24..C26`` hold
their tokens joined with ``,`` (an empty list is an empty field). To look like real logs, 2-5% of
each dense and single-valued categorical field is blanked (an empty field is a null), with a
per-column rate and a separate seeded generator, so the parquet form is unaffected.

Tokens are a bijection of (feature, id): ``hex_tokens(f, ids)`` gives distinct tokens for distinct
ids of one feature, so an ingested vocabulary maps one-to-one onto the generator's ids.

Example:
    >>> from embedtrain.datagen import CTRDataSpec, generate_ctr_tsv
    >>> info = generate_ctr_tsv(CTRDataSpec(rows=20_000), "/tmp/ctr_tsv", progress=False)
    >>> info["files"]
    ['part-00000.tsv']
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from embedtrain.datagen.ctr import (
    DENSE_NAMES, MULTI_HOT, SPARSE_NAMES, CTRDataSpec, PlantedModel, iter_chunks)
from embedtrain.utils import progress_bar

LIST_SEPARATOR = ","
INFO_FILE = "datagen.json"
_TSV_RE = re.compile(r"part-\d{5}\.tsv")
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def null_rate(column: str) -> float:
    """Share of blanked fields in ``column`` (0 for the label and the multi-hot lists).

    Rates are spread over 2%..5% with a fixed stride so that neighbouring columns differ.
    """
    if column in DENSE_NAMES:
        k = DENSE_NAMES.index(column)
    elif column in SPARSE_NAMES and column not in MULTI_HOT:
        k = SPARSE_NAMES.index(column) + 13
    else:
        return 0.0
    return 0.02 + 0.03 * ((7 * k) % 13) / 12


def hex_tokens(feature_index: int, ids: np.ndarray) -> np.ndarray:
    """8-hex-digit tokens (``np.bytes_``, shape of ``ids``) for ids of feature ``C{index + 1}``.

    The token is ``lowbias32(id + salt)`` (a bijection of 32-bit integers), so distinct ids of
    one feature never share a token, and the same id of two features almost never does.

    Args:
        feature_index: 0-based index into ``SPARSE_NAMES``.
        ids: non-negative integer ids below 2**32.

    Returns:
        An array of dtype ``S8``.
    """
    x = (np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B9 * (feature_index + 1))) \
        & np.uint64(0xFFFFFFFF)
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    digits = _HEX[(x[..., None] >> shifts) & np.uint32(0xF)]
    return np.ascontiguousarray(digits).view("S8").reshape(x.shape)


def _string_array(tokens: np.ndarray, null_mask: np.ndarray | None = None) -> pa.Array:
    n = len(tokens)
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    validity = None
    if null_mask is not None and null_mask.any():
        validity = pa.array(~null_mask).buffers()[1]
    return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offsets),
                                                  pa.py_buffer(tokens.tobytes())])


def _tsv_table(model: PlantedModel, draw, labels: np.ndarray, rng: np.random.Generator
               ) -> pa.Table:
    n = len(labels)
    cols, names = [pa.array(labels.astype(np.int8))], ["label"]
    for j, name in enumerate(DENSE_NAMES):
        cols.append(pa.array(draw.dense[j], mask=rng.random(n) < null_rate(name)))
        names.append(name)
    for f, name in enumerate(SPARSE_NAMES):
        tokens = hex_tokens(f, model.perm[name][draw.ranks[name]])
        if name in MULTI_HOT:
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(draw.lengths[name], out=offsets[1:])
            lists = pa.ListArray.from_arrays(pa.array(offsets), _string_array(tokens))
            cols.append(pc.binary_join(lists, LIST_SEPARATOR))
        else:
            cols.append(_string_array(tokens, rng.random(n) < null_rate(name)))
        names.append(name)
    return pa.Table.from_arrays(cols, names=names)


def _clear_old(out: Path) -> None:
    ours = [p for p in out.iterdir() if _TSV_RE.fullmatch(p.name)] if out.is_dir() else []
    if ours and not (out / INFO_FILE).exists():
        raise FileExistsError(f"{out} holds part-*.tsv files not written by datagen; "
                              "refusing to overwrite")
    (out / INFO_FILE).unlink(missing_ok=True)
    for p in ours:
        p.unlink()


def generate_ctr_tsv(spec: CTRDataSpec, out_dir: str | os.PathLike, progress: bool = True
                     ) -> dict:
    """Write the data set of ``spec`` as ``out_dir/part-NNNNN.tsv`` plus ``out_dir/datagen.json``.

    Files hold ``spec.rows_per_file`` lines each (the last one fewer); the split fractions of
    ``spec`` are ignored. Earlier ``part-*.tsv`` files are replaced if ``datagen.json`` shows
    they came from here, otherwise ``FileExistsError``. The same spec always gives the same bytes.

    Args:
        spec: size, seed and file layout (as for the parquet form).
        out_dir: destination folder (created if missing).
        progress: show a progress bar on stderr (rows done / total, rows/s).

    Returns:
        The dict written to ``datagen.json``: ``format``, ``rows``, ``files``, ``columns``,
        ``list_separator``, ``null_rates`` and the generator's seed.

    Example:
        >>> info = generate_ctr_tsv(CTRDataSpec(rows=1000, seed=3), "/tmp/tsv", progress=False)
        >>> info["rows"], len(info["columns"])
        (1000, 40)
    """
    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_old(out)
    model = PlantedModel(spec)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    files: list[str] = []
    writer, file_rows = None, 0
    with progress_bar(spec.rows, "datagen", disable=not progress) as bar:
        for chunk in iter_chunks(spec, model):
            # A separate generator for the blanks: the parquet form's draws stay untouched.
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 3, chunk.index]))
            table = _tsv_table(model, chunk.draw, chunk.labels, rng)
            while table.num_rows:
                if writer is None:
                    files.append(f"part-{len(files):05d}.tsv")
                    writer = pacsv.CSVWriter(str(out / files[-1]), table.schema,
                                             write_options=options)
                k = min(table.num_rows, spec.rows_per_file - file_rows)
                writer.write_table(table.slice(0, k))
                table, file_rows = table.slice(k), file_rows + k
                if file_rows == spec.rows_per_file:
                    writer.close()
                    writer, file_rows = None, 0
            bar.update(len(chunk.labels))
    if writer is not None:
        writer.close()
    columns = ["label", *DENSE_NAMES, *SPARSE_NAMES]
    info = {
        "format": "criteo_tsv",
        "rows": int(spec.rows),
        "files": files,
        "columns": columns,
        "multi_hot": list(MULTI_HOT),
        "list_separator": LIST_SEPARATOR,
        "null_rates": {c: round(null_rate(c), 6) for c in columns if null_rate(c)},
        "generator": {"seed": int(spec.seed), "zipf_exponent": float(spec.zipf_exponent)},
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info
