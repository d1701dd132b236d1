"""Input files every family reads the same way: resolution, cheap per-file checks, file splits.

- :func:`resolve_inputs`: ``--input`` paths, directories and globs to a sorted list of files
  (a compressed text input named as such: :func:`compression`);
- :func:`parquet_types`, :func:`value_type`, :func:`check_csv_header`: what a parquet footer or a
  CSV header line says about a file's columns, read without scanning it, with one-line errors
  naming the file;
- :func:`file_splits`: split method ``files``, each input file's split from the spec's globs;
- :func:`csv_header`: a CSV header line's names as written, refused when not UTF-8 or when a
  name appears twice (a scan would silently read the first);
- :func:`invalid_utf8`, :func:`utf8_failure`: the line of a file's first byte that is not
  UTF-8, found by a cheap scan once a read has failed on it;
- :func:`csv_lines`: the 1-based lines of a CSV file's 0-based data rows (a quoted field may
  span lines, so a row is not always at line ``row + 2``).

:data:`ROW` and :data:`FILE` are the columns the scans add: a row's 0-based position in the whole
input, and (split method ``files``) its input file. A family's own ``read.py`` holds its layouts'
checks and scans.

Example:
    >>> files = resolve_inputs(["data/raw/*.tsv"], spec)
    >>> parquet_types(files[0], ["label", "C1"])  # doctest: +SKIP
"""

from __future__ import annotations

import codecs
import csv
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
KEEP_PREFIX = "__keep:"  # serving: an input column carried to the output (its name may be a feature's)
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
    if spec.input.format is not InputFormat.PARQUET:
        for path in files:
            kind = compression(path)
            if kind is not None:  # else "not UTF-8" or "line 1 has 2 fields" would follow
                raise IngestError(f"{path}: {kind}-compressed; {spec.input.format.value} input is "
                                  f"read as plain text: decompress it first "
                                  f"(e.g. {_TOOLS[kind]} {path.name})")
    return files


# The first bytes of the compressed formats a text input may come in, and their tools.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"))
_TOOLS = {"gzip": "gunzip -k", "bzip2": "bunzip2 -k", "xz": "unxz -k", "zstd": "unzstd",
          "zip": "unzip"}


def compression(path: Path) -> Optional[str]:
    """The compressed format ``path`` starts with (``gzip``, ``bzip2``, ``xz``, ``zstd``,
    ``zip``), from its first bytes; ``None`` for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None  # the read that follows names the problem
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)


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
    """The CSV file's column names, checked to hold ``columns`` and to name each column once
    (:func:`csv_header`); ``None``: an empty file."""
    if path.stat().st_size == 0:
        return None  # no header, no rows: counted as an empty file
    csv_header(path, separator)
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


def csv_header(path: Path, separator: Optional[str]) -> list[str]:
    """The names of a CSV file's header line (line 1) as written.

    Raises:
        IngestError: ``<file>: line 1: ...`` for a header that is not UTF-8 text or that names a
            column twice (a scan would read the first of the two and never the other).
    """
    with open(path, "rb") as f:
        raw = f.readline(1 << 20)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise IngestError(f"{path}: line 1: {_not_utf8(raw[e.start])}") from None
    names = next(csv.reader([text.rstrip("\r\n")], delimiter=separator or ",", quotechar='"'),
                 [])
    seen: dict[str, int] = {}
    for i, name in enumerate(names, start=1):
        if name in seen:
            raise IngestError(f"{path}: line 1: column {name} appears twice in the header "
                              f"(fields {seen[name]} and {i}); column names must be unique: "
                              "rename or remove one of them")
        seen[name] = i
    return names


def _not_utf8(byte: int) -> str:
    return (f"not UTF-8 text (byte 0x{byte:02x}); re-encode the file as UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)")


def invalid_utf8(path: Path, chunk: int = 1 << 24) -> Optional[tuple[int, int]]:
    """``(line, byte)``: the 1-based line and the value of the file's first byte that is not
    valid UTF-8; ``None`` if the whole file is. One sequential read, in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                # e.object: the previous chunk's incomplete tail (no newline in it) + data
                return lines + e.object[:e.start].count(b"\n") + 1, e.object[e.start]
            if not data:
                return None
            lines += data.count(b"\n")


def utf8_failure(paths: Sequence[Path], error: Exception) -> Optional[IngestError]:
    """For a read that failed on invalid UTF-8: the one-line error naming the first of the
    (text) ``paths`` holding such a byte and its line; ``None`` for another failure, or when
    no file holds one."""
    if "utf8" not in str(error).lower().replace("-", ""):
        return None
    for path in paths:
        found = invalid_utf8(Path(path))
        if found is not None:
            return IngestError(f"{path}: line {found[0]}: {_not_utf8(found[1])}")
    return None


def _holds(path: Path, needle: bytes, chunk: int = 1 << 24) -> bool:
    with open(path, "rb") as f:
        while data := f.read(chunk):
            if needle in data:
                return True
    return False


def csv_lines(path: Path, separator: Optional[str], rows: Sequence[int]) -> dict[int, int]:
    """The 1-based line of each of a CSV file's 0-based data ``rows`` (the header is line 1).

    ``row + 2`` unless a quoted field before the row spans several lines; then the file is
    scanned (as the job reads it, up to the last row asked for) counting the line breaks inside
    fields. Only for messages and the report's examples: never on a job's normal path.
    """
    wanted = sorted({int(r) for r in rows})
    if not wanted or not _holds(Path(path), b'"'):
        return {r: r + 2 for r in wanted}
    frame = pl.scan_csv(path, separator=separator or ",", infer_schema=False, quote_char='"',
                        raise_if_empty=False)
    header = sum(name.count("\n") for name in frame.collect_schema().names())
    breaks = frame.head(wanted[-1] + 1).select(pl.sum_horizontal(
        pl.all().str.count_matches("\n", literal=True).fill_null(0)).alias("n")).collect()["n"]
    before = (breaks.cum_sum() - breaks).to_list()
    return {r: r + 2 + header + (int(before[r]) if r < len(before) else 0) for r in wanted}
