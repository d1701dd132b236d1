"""Input files every family reads the same way: resolution, cheap per-file checks, file splits.

- :func:`resolve_inputs`: ``--input`` paths, directories and globs to a sorted list of files;
- :func:`parquet_types`, :func:`value_type`, :func:`check_csv_header`: what a parquet footer or a
  CSV header line says about a file's columns, read without scanning it, with one-line errors
  naming the file;
- :func:`file_splits`: split method ``files``, each input file's split from the spec's globs.

:data:`ROW` and :data:`FILE` are the columns the scans add: a row's 0-based position in the whole
input, and (split method ``files``) its input file. A family's own ``read.py`` holds its layouts'
checks and scans.

Example:
    >>> files = resolve_inputs(["data/raw/*.tsv"], spec)
    >>> parquet_types(files[0], ["label", "C1"])  # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.utils import first_line, natural_key
from pipelines.core.errors import IngestError
from pipelines.core.fields import InputFormat, ValueType

ROW = "__row"
FILE = "__file"  # split method files: the row's input file (as resolved from --input)
_EXTENSIONS = {
    InputFormat.CRITEO_TSV: (".tsv", ".txt"),
    InputFormat.CSV: (".csv", ".tsv", ".txt"),
    InputFormat.PARQUET: (".parquet",),
}


def resolve_inputs(patterns: Sequence[str | os.PathLike], spec: Any) -> list[Path]:
    """Expands paths, directories and globs into a sorted, de-duplicated list of files.

    A directory stands for its files with the input format's extensions (``.tsv``/``.txt`` for
    ``criteo_tsv``, ``.parquet`` for parquet, ...). File order matters (row-order time splits,
    and hash splits without a key column, use it), so each pattern's files are sorted with numbers
    compared as numbers (``day_2`` before ``day_10``) and patterns keep their command-line order.

    Args:
        patterns: ``--input`` values.
        spec: the job's spec; only ``spec.input.format`` (an :class:`InputFormat`) is read.

    Returns:
        The files.

    Raises:
        IngestError: a pattern matching no file.
    """
    files: list[Path] = []
    for pattern in patterns:
        pattern = str(pattern)
        path = Path(pattern)
        if path.is_dir():
            found = sorted((p for p in path.iterdir()
                            if p.is_file() and p.name.endswith(_EXTENSIONS[spec.input.format])),
                           key=natural_key)
            what = f"no {'/'.join(_EXTENSIONS[spec.input.format])} files in the directory"
        elif glob.has_magic(pattern):
            found = sorted((Path(p) for p in glob.glob(pattern, recursive=True)
                            if Path(p).is_file()), key=natural_key)
            what = "no input files match"
        else:
            found = [path] if path.is_file() else []
            what = "input file not found"
        if not found:
            raise IngestError(f"{pattern}: {what}")
        files.extend(p for p in found if p not in files)
    return files


def value_type(t: pa.DataType) -> Optional[ValueType]:
    """How an Arrow type's values are typed for a categorical column (``None``: neither)."""
    if pa.types.is_integer(t):
        return ValueType.INTEGER
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ValueType.STRING
    return None


def parquet_types(path: Path, columns: Sequence[str]) -> dict[str, pa.DataType]:
    """A parquet file's column types, checked to hold ``columns`` (one-line errors)."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise IngestError(f"{path}: not a readable parquet file (truncated or corrupt?): "
                          f"{first_line(e)}") from None
    types = {f.name: f.type for f in schema}
    missing = [c for c in columns if c not in types]
    if missing:
        raise IngestError(f"{path}: missing column(s) {', '.join(missing)} "
                          f"(has: {', '.join(list(types)[:20])})")
    return types


def check_csv_header(path: Path, separator: Optional[str], columns: list[str]
                     ) -> Optional[list[str]]:
    """The CSV file's column names, checked to hold ``columns`` (``None``: an empty file)."""
    if path.stat().st_size == 0:
        return None  # no header, no rows: counted as an empty file
    try:
        names = pl.scan_csv(path, separator=separator or ",", infer_schema=False,
                            n_rows=0).collect_schema().names()
    except pl.exceptions.PolarsError as e:
        raise IngestError(f"{path}: cannot read the CSV header: {first_line(e)}") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise IngestError(f"{path}: missing column(s) {', '.join(missing)} "
                          f"(header has: {', '.join(names[:20])})")
    return names


def file_splits(files: list, spec: Any) -> dict[str, str]:
    """Split method files: input path (as scanned) -> the split whose glob matches the file's path
    or name; files that no glob matches are train. Only ``spec.split.files`` (split -> glob) is
    read.

    Raises:
        IngestError: a file matched by two splits' globs.
    """
    out: dict[str, str] = {}
    for path in files:
        hits = [split for split, pattern in (spec.split.files or {}).items()
                if fnmatch.fnmatch(str(path), pattern) or fnmatch.fnmatch(Path(path).name, pattern)]
        if len(hits) > 1:
            raise IngestError(f"{path}: matches split.files of both {hits[0]} and {hits[1]}")
        out[str(path)] = hits[0] if hits else "train"
    return out
