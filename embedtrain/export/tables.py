"""Checkpointed tables to files, one DCP shard at a time; quantized rows; tables for inference.

Reading: :func:`stream_tensor` runs ``torch.distributed.checkpoint.load`` on one process (no
process group) for one tensor of a checkpoint, with a storage reader (:class:`ShardReader`) that
hands every shard DCP reads -- a rank's rows of a row-wise table, a table of a table-wise plan,
a column block -- to a callback instead of copying it into a state dict. The target is a
``meta`` tensor of the full shape: the whole table never exists in memory, only the shard being
written (a 1-rank checkpoint's shard is the whole table: the peak stays one table). A
checkpoint of any number of ranks and any sharding reads this way on one process.

Writing: :class:`NpyWriter` puts each shard at its rows (and columns) of a float32 ``.npy``
(or, for a bfloat16 class head, a ``uint16`` ``.npy`` of the bfloat16 bit patterns: NumPy has no
bfloat16; :func:`checkpoint_dtypes` says which a tensor was saved as); :func:`npy_blocks` reads it
back in row blocks, from which :func:`write_parquet` writes ``id, vector`` rows (float32 lists;
bfloat16 bits widened block by block, exactly) and :func:`quantize_npy` FBGEMM's fused rowwise
int8/int4 rows (TorchRec's own ``quantize_state_dict``, block by block: rowwise quantization of a
block equals that of the table).

Dynamic tables: :func:`checkpoint_id_map` reads a table's remapping state (its sorted mixed ids,
their rows and the run's shard starts: 16 bytes a row, read whole) into the raw id -> row map
that :func:`write_id_map` writes as ``tables/<table>.ids.parquet`` and :func:`read_id_map` reads
back (what the files mean: :mod:`embedtrain.export.manifest`).

Inference: :func:`float_collection` and :func:`quantized_collection` build TorchRec's
``EmbeddingBagCollection`` (the unsharded module training's tables come from) and its quantized
inference version (``torchrec.quant``) from the exported files.

Example:
    >>> with NpyWriter("tables/t_C1.npy", (rows, dim)) as out:
    ...     shards = stream_tensor(ckpt, "model.sparse_arch...t_C1.weight", (rows, dim), out.write)
    >>> quantize_npy("tables/t_C1.npy", "tables/t_C1.int8.npy", "int8")
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantCollection
from torchrec.quant.embedding_modules import quantize_state_dict

from embedtrain.export.manifest import BITS, Shard
from embedtrain.tables.dynamic import EMPTY_ID, unmix_ids
from embedtrain.train.checkpoint import CheckpointError, SafeFileSystemReader, describe_error
from embedtrain.runtime import release_freed_memory
from embedtrain.utils import writing

BLOCK_BYTES = 1 << 20  # rows are converted, written and quantized this many bytes at a time
SCALE_BIAS_BYTES = 4  # fp16 scale + fp16 bias after each quantized row
QUANT_ROW_ALIGNMENT = 4  # bytes; the quantized tables' rows in memory at inference

ShardSink = Callable[[tuple[int, int], torch.Tensor], None]
# how each exported dtype is stored in an .npy: bfloat16 and float8 as their bit patterns
NPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16),
              "float8_e4m3fn": np.dtype(np.uint8)}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}
_BITS = {2: torch.uint16, 1: torch.uint8}  # the integer view of a low-precision block


def block_rows(dim: int, itemsize: int = 4) -> int:
    """Rows per block of :data:`BLOCK_BYTES` (at least one)."""
    return max(1, BLOCK_BYTES // max(1, dim * itemsize))


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable read-only stream."""

    def __init__(self, file, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n])
        self._pos += got
        return got


class ShardReader(SafeFileSystemReader):
    """A DCP ``FileSystemReader`` that gives each shard it reads to ``sink(offsets, tensor)``.

    ``offsets`` are the shard's (row, column) offsets in the full tensor; shards come in row
    order. Every shard is deserialised with ``torch.load(..., weights_only=True)`` (no pickle),
    narrowed to what was asked, handed over and dropped before the next one is read.
    """

    def __init__(self, path: str | os.PathLike, sink: ShardSink) -> None:
        super().__init__(path)
        self._sink = sink
        self.shards: list[Shard] = []
        self.error: Optional[str] = None  # what failed (DCP wraps the exception)
        # an error of the sink (writing the output: a full disk) or an interruption, raised
        # as it is by stream_tensor rather than as the checkpoint's
        self.passed: Optional[BaseException] = None

    def read_data(self, plan, planner) -> Future:
        for req in sorted(plan.items, key=lambda r: tuple(r.dest_offsets)):
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{self.path}: {req.dest_index.fqn} is not a tensor")
            info = self.storage_data[req.storage_index]
            file = Path(self.path) / info.relative_path
            try:
                with open(file, "rb") as f:
                    stream = _Window(f, info.offset, info.length)
                    if info.transform_descriptors:  # e.g. compressed shards: DCP's transforms
                        stream = io.BytesIO(self.transforms.transform_load_stream(
                            req, info.transform_descriptors, stream).read())
                    tensor = torch.load(stream, map_location="cpu", weights_only=True)
            except (KeyboardInterrupt, SystemExit) as e:  # a SIGTERM or Ctrl-C, not the file
                self.passed = e
                raise
            except (OSError, EOFError, RuntimeError, ValueError) as e:
                why = ("it ends before the shard (truncated?)" if isinstance(e, EOFError)
                       else describe_error(e))
                self.error = f"{file}: cannot read {req.dest_index.fqn}: {why}"
                raise CheckpointError(self.error) from None
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if start or length != tensor.shape[dim]:
                    tensor = tensor.narrow(dim, start, length)
            offsets = tuple(req.dest_offsets) + (0,) * (2 - len(req.dest_offsets))
            self.shards.append(Shard(int(offsets[0]), int(offsets[1]), int(tensor.shape[0]),
                                     int(tensor.shape[1]) if tensor.dim() > 1 else 1))
            try:
                self._sink((int(offsets[0]), int(offsets[1])), tensor)
            except BaseException as e:  # noqa: BLE001 - the output's error (DCP wraps it)
                self.passed = e
                raise
            del tensor
        fut: Future = Future()
        fut.set_result(None)
        return fut


class _MetaTargetPlanner(DefaultLoadPlanner):
    """Plans the reads of a flat state dict of ``meta`` targets without allocating them
    (``DefaultLoadPlanner`` first materialises every ``meta`` tensor; :class:`ShardReader`
    never writes into the targets)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator


def checkpoint_tensors(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The tensors of a DCP checkpoint and their full shapes (from its ``.metadata``).

    Raises:
        CheckpointError: the metadata cannot be read (one line naming the checkpoint).
    """
    return {k: tuple(v.size) for k, v in _tensor_metadata(path).items()}


def checkpoint_dtypes(path: str | os.PathLike) -> dict[str, torch.dtype]:
    """The tensors of a DCP checkpoint and the dtypes they were saved in (from its
    ``.metadata``; nothing else is read).

    Raises:
        CheckpointError: the metadata cannot be read (one line naming the checkpoint).
    """
    return {k: v.properties.dtype for k, v in _tensor_metadata(path).items()}


def _tensor_metadata(path: str | os.PathLike) -> dict:
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except CheckpointError:
        raise  # a refused .metadata, named
    except Exception as e:  # noqa: BLE001 - truncated/corrupt/missing .metadata: one line
        raise CheckpointError(f"{path}: cannot read: {describe_error(e)}") from None
    return {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def stream_tensor(path: str | os.PathLike, key: str, shape: Sequence[int],
                  sink: ShardSink) -> list[Shard]:
    """Reads tensor ``key`` of the checkpoint at ``path`` shard by shard into ``sink``.

    Returns:
        The shards read, in row order.

    Raises:
        CheckpointError: the checkpoint cannot be read (one line naming it and the cause).
    """
    reader = ShardReader(path, sink)
    target = {key: torch.empty(tuple(shape), device="meta")}
    try:
        dcp.load(target, storage_reader=reader, planner=_MetaTargetPlanner(), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP wraps read errors in CheckpointException
        if reader.passed is not None:  # the sink's (the output's) error, or an interruption
            raise reader.passed from None
        _raise_interruption(e)
        raise CheckpointError(reader.error or f"{path}: cannot read {key}: "
                                              f"{describe_error(e)}") from None
    finally:
        release_freed_memory()
    return reader.shards


def _raise_interruption(e: BaseException) -> None:
    """Raises ``e``, or what DCP wrapped in it, where that is a ``KeyboardInterrupt`` (Ctrl-C,
    a SIGTERM while a file is written: :class:`embedtrain.utils.Stopped`) or ``SystemExit``:
    an interruption, not a checkpoint that cannot be read."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise inner from None


def load_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Fills ``tensors`` (small ones: the dense parameters) from the checkpoint, in place."""
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path),
                 planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
    except BaseException as e:  # noqa: BLE001 - one line for DCP's many failure kinds
        _raise_interruption(e)
        raise CheckpointError(f"{path}: cannot read the dense parameters: "
                              f"{describe_error(e)}") from None


# the remapper's buffers of a dynamic table, under its checkpoint key prefix
SORTED_IDS, ROWS_OF_IDS, SEGMENTS = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping",
                                     "_output_segments_tensor")


def checkpoint_id_map(path: str | os.PathLike, prefix: str, rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A dynamic table's ``(raw ids, rows, segments)`` in a checkpoint: the ids that own a row
    (ascending, unmixed by :func:`embedtrain.tables.dynamic.unmix_ids`) and their rows, and the
    run's row-wise shard starts followed by ``rows``.

    ``prefix`` is the checkpoint key of the table's remapper (``model....
    _managed_collision_modules.<table>``). The remapper's buffers hold, per row-wise shard, the
    mixed ids that own a row, sorted, then ``EMPTY_ID`` for the free rows; each shard's last
    entry stands for its default row and is never looked up.

    Raises:
        CheckpointError: a buffer is missing or unreadable, or the state is inconsistent (an
            id held twice, a row outside the table or held twice, segments that do not end at
            ``rows``).
    """
    tensors = {f"{prefix}.{SORTED_IDS}": torch.empty(rows, dtype=torch.int64),
               f"{prefix}.{ROWS_OF_IDS}": torch.empty(rows, dtype=torch.int64),
               f"{prefix}.{SEGMENTS}": torch.empty(1025, dtype=torch.int64)}
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path), no_dist=True,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    except BaseException as e:  # noqa: BLE001 - one line for DCP's many failure kinds
        _raise_interruption(e)
        raise CheckpointError(f"{path}: cannot read the remapping state of {prefix}: "
                              f"{describe_error(e)}") from None
    mixed, mapped, padded = tensors.values()
    segments = [int(v) for v in padded.tolist() if v >= 0]
    where = f"{path}: {prefix}"
    if (len(segments) < 2 or segments[0] != 0 or segments[-1] != rows
            or any(a >= b for a, b in zip(segments, segments[1:]))):
        raise CheckpointError(f"{where}.{SEGMENTS}: {segments} are not shard starts of a "
                              f"{rows}-row table")
    keep = mixed != EMPTY_ID
    keep[torch.tensor(segments[1:]) - 1] = False  # each shard's default row
    ids, held = unmix_ids(mixed[keep]), mapped[keep]
    order = torch.argsort(ids)
    ids, held = ids[order], held[order]
    defaults = torch.tensor([s - 1 for s in segments[1:]])
    if bool((ids[1:] == ids[:-1]).any()):
        raise CheckpointError(f"{where}.{SORTED_IDS}: an id is held twice")
    if held.numel() and (int(held.min()) < 0 or int(held.max()) >= rows
                         or torch.unique(held).numel() != held.numel()
                         or bool(torch.isin(held, defaults).any())):
        raise CheckpointError(f"{where}.{ROWS_OF_IDS}: rows outside the table's {rows}, held "
                              f"twice, or a default row")
    return ids, held, segments


def write_id_map(path: str | os.PathLike, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``id`` and ``row`` (int64; ids ascending) as parquet (no dictionary: nothing repeats)."""
    table = pa.table({"id": _arrow(ids.numpy().astype(np.int64, copy=False)),
                      "row": _arrow(rows.numpy().astype(np.int64, copy=False))})
    with writing(path):  # a full disk names the file
        pq.write_table(table, path, use_dictionary=False)


def read_id_map(path: str | os.PathLike, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An id map's ``(ids, rows)`` as int64 tensors, checked: ids strictly ascending, rows in
    ``[0, rows)``.

    Raises:
        ValueError: unreadable, or not an id map of a ``rows``-row table (the file named).
    """
    try:
        table = pq.read_table(path, columns=["id", "row"])
    except (OSError, pa.ArrowException, KeyError) as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
    out = []
    for name in ("id", "row"):
        column = table.column(name)
        if column.type != pa.int64() or column.null_count:
            raise ValueError(f"{path}: column {name}: expected int64 without nulls, got "
                             f"{column.type}")
        out.append(torch.from_numpy(column.to_numpy().copy()))
    ids, held = out
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(f"{path}: column id: not strictly ascending")
    if held.numel() and (int(held.min()) < 0 or int(held.max()) >= rows):
        raise ValueError(f"{path}: column row: rows outside [0, {rows})")
    return ids, held


class NpyWriter:
    """A ``.npy`` of ``shape`` filled by shards at their offsets (:meth:`write`): float32, or
    with ``dtype="bfloat16"`` (``"float8_e4m3fn"``) uint16 (uint8) holding the bit patterns
    (:data:`NPY_DTYPES`).

    Full-width shards are written with plain file writes straight from the shard's memory (a
    shard of another dtype is converted one row block at a time); column blocks (column-wise
    sharding) one row block at a time: its rows read, their columns set, written back. Plain
    writes only (no memory map, whose write to a full disk is a SIGBUS): a full disk is an
    ``OSError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike, shape: Sequence[int],
                 dtype: str = "float32") -> None:
        self.path = Path(path)
        self.shape = (int(shape[0]), int(shape[1]) if len(shape) > 1 else 1)
        self.dtype, self._torch_dtype = NPY_DTYPES[dtype], TORCH_DTYPES[dtype]
        with writing(self.path):  # a full disk names the file
            header = np.lib.format.open_memmap(self.path, mode="w+", dtype=self.dtype,
                                               shape=self.shape)  # the header, the file's size
            self.offset = header.offset
            del header  # nothing of the data was touched
            self._file = open(self.path, "r+b")

    def write(self, offsets: tuple[int, int], shard: torch.Tensor) -> None:
        with writing(self.path):  # a full disk names the file
            self._write(offsets, shard)

    def _write(self, offsets: tuple[int, int], shard: torch.Tensor) -> None:
        row0, col0 = offsets
        shard = shard.reshape(shard.shape[0], -1)
        rows, cols = shard.shape
        width, size = self.shape[1], self.dtype.itemsize
        step = block_rows(width, size)
        for start in range(0, rows, step):
            block = shard[start:start + step].to(self._torch_dtype).contiguous()
            block = block.view(_BITS[size]).numpy() if size in _BITS else block.numpy()
            first = row0 + start
            if cols == width:
                self._file.seek(self.offset + first * width * size)
                self._file.write(memoryview(block).cast("B"))
            else:  # the block's rows read, their columns set, written back
                rows_here = np.empty((block.shape[0], width), dtype=self.dtype)
                self._file.seek(self.offset + first * width * size)
                self._file.readinto(memoryview(rows_here).cast("B"))
                rows_here[:, col0:col0 + cols] = block
                self._file.seek(self.offset + first * width * size)
                self._file.write(memoryview(rows_here).cast("B"))

    def close(self) -> None:
        with writing(self.path):
            self._file.close()

    def __enter__(self) -> "NpyWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def npy_blocks(path: str | os.PathLike, rows_per_block: Optional[int] = None
               ) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, block)`` of a 2-D ``.npy``, read with plain file reads (no memory map)."""
    with open(path, "rb") as f:
        shape, fortran, dtype = _npy_header(f)
        if fortran or len(shape) != 2:
            raise ValueError(f"{path}: expected a C-ordered 2-D array, got shape {shape}")
        rows, width = shape
        step = rows_per_block or block_rows(width, dtype.itemsize)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            block = np.empty((n, width), dtype)
            f.readinto(memoryview(block).cast("B"))
            yield start, block


def _npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` open at its start; leaves ``f`` at
    the data."""
    version = np.lib.format.read_magic(f)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    return read(f)


def bits_to_float32(block: np.ndarray) -> np.ndarray:
    """A block of an exported ``.npy`` as float32: bfloat16 (uint16) and float8 e4m3 (uint8) bit
    patterns viewed as their torch dtype and widened exactly, float32 as it is."""
    if block.dtype == np.float32:
        return block
    name = next(n for n, d in NPY_DTYPES.items() if d == block.dtype)
    return torch.from_numpy(block).view(TORCH_DTYPES[name]).float().numpy()


def write_parquet(npy: str | os.PathLike, out: str | os.PathLike) -> None:
    """The float table ``npy`` as parquet: ``id`` (int64, the row) and ``vector``
    (``list<float32>``), one row group per block (no dictionary: ids and floats do not repeat).
    A bfloat16 or float8 ``npy`` (uint16 or uint8 bits) is widened to float32 block by block."""
    writer = None
    try:
        with writing(out):  # a full disk names the file written
            try:
                for start, block in npy_blocks(npy):
                    block = bits_to_float32(block)
                    n, dim = block.shape
                    vectors = pa.ListArray.from_arrays(
                        _arrow(np.arange(0, (n + 1) * dim, dim, dtype=np.int32)),
                        _arrow(block.reshape(-1)))
                    table = pa.table({"id": _arrow(np.arange(start, start + n, dtype=np.int64)),
                                      "vector": vectors})
                    if writer is None:
                        writer = pq.ParquetWriter(out, table.schema, use_dictionary=False)
                    writer.write_table(table)
            finally:
                if writer is not None:
                    writer.close()
    finally:
        pa.default_memory_pool().release_unused()  # Arrow's allocator keeps freed pages
        release_freed_memory()


def _arrow(values: np.ndarray) -> pa.Array:
    """A 1-D NumPy array as an Arrow array over the same memory (``pa.array`` would import
    pandas, ~40 MB of a process that writes tables within a bounded memory)."""
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values),
                                 [None, pa.py_buffer(values)])


def quantized_width(dim: int, dtype: str) -> int:
    """Bytes of one fused quantized row: the codes, then fp16 scale and fp16 bias."""
    return dim * BITS[dtype] // 8 + SCALE_BIAS_BYTES


def quantize_rows(block: torch.Tensor, dtype: str, table: str = "t") -> torch.Tensor:
    """Fused rowwise ``int8``/``int4`` rows of a float block, by TorchRec's quantizer
    (``torchrec.quant.embedding_modules.quantize_state_dict``, what ``quantize_embeddings`` and
    ``EmbeddingBagCollection.from_float`` run)."""
    holder = nn.Module()
    holder.embedding_bags = nn.Module()
    holder.embedding_bags.add_module(table, nn.Module())
    getattr(holder.embedding_bags, table).register_buffer("weight", block)
    out: dict = {}
    data_type = DataType.INT8 if dtype == "int8" else DataType.INT4
    quantize_state_dict(holder, out, {table: data_type})
    codes, scale_bias = out[table]
    return torch.cat([codes, scale_bias], dim=1)


def quantize_npy(npy: str | os.PathLike, out: str | os.PathLike, dtype: str) -> int:
    """Writes the fused quantized rows of the float table ``npy`` to ``out`` (uint8
    ``[rows, width]``), block by block. Returns the data's bytes."""
    with open(npy, "rb") as f:
        (rows, dim), _, _ = _npy_header(f)
    width = quantized_width(dim, dtype)
    with writing(out):  # a full disk names the file written
        header = np.lib.format.open_memmap(out, mode="w+", dtype=np.uint8, shape=(rows, width))
        offset = header.offset
        del header
        with open(out, "r+b") as f:
            f.seek(offset)
            for _, block in npy_blocks(npy):
                fused = quantize_rows(torch.from_numpy(block), dtype).numpy()
                f.write(memoryview(np.ascontiguousarray(fused)).cast("B"))
    release_freed_memory()
    return rows * width


def read_table(root: Path, npy: Optional[str], parquet: Optional[str],
               shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """An exported table as an array: its ``.npy`` memory-mapped (copy-on-write: pages are read
    when looked up), else its parquet ``vector`` column read into memory (float32 only; a
    bfloat16 head is read from its ``.npy``: ``uint16``)."""
    if npy is not None:
        path = root / npy
        try:
            array = np.load(path, mmap_mode="c")
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable: {e}") from None
    elif parquet is not None and np.dtype(dtype) == np.float32:
        path = root / parquet
        try:
            column = pq.read_table(path, columns=["vector"]).column("vector")
        except (OSError, pa.ArrowException, KeyError) as e:
            raise ValueError(f"{path}: unreadable: {e}") from None
        flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
        array = flat.astype(dtype, copy=False).reshape(len(column), -1)
    else:
        raise ValueError(f"{root}: a table has no file" if parquet is None else
                         f"{root / parquet}: a {np.dtype(dtype)} table is read from an .npy")
    if tuple(array.shape) != tuple(shape) or array.dtype != dtype:
        raise ValueError(f"{path}: holds {array.dtype} {tuple(array.shape)}, model.json says "
                         f"{np.dtype(dtype)} {tuple(shape)}")
    return array


def _configs(tables, data_type=None) -> list:
    extra = {} if data_type is None else {"data_type": data_type}
    return [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                               feature_names=list(t.features),
                               pooling=PoolingType[t.pooling.upper()], **extra)
            for t in tables]


def float_collection(tables, arrays: Sequence[np.ndarray]) -> nn.Module:
    """TorchRec's ``EmbeddingBagCollection`` over the float tables ``arrays`` (not copied);
    tables of pooling ``none`` (all or none of them): its ``EmbeddingCollection``, which looks
    each id up on its own (a sequence's positions)."""
    if all(t.pooling == "none" for t in tables):
        ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                            feature_names=list(t.features)) for t in tables],
            device=torch.device("meta"))
        for t, array in zip(tables, arrays):
            ec.embeddings[t.name].weight = nn.Parameter(torch.from_numpy(array),
                                                        requires_grad=False)
        return ec.eval()
    ebc = EmbeddingBagCollection(tables=_configs(tables), device=torch.device("meta"))
    for t, array in zip(tables, arrays):
        ebc.embedding_bags[t.name].weight = nn.Parameter(torch.from_numpy(array),
                                                         requires_grad=False)
    return ebc.eval()


def quantized_collection(tables, arrays: Sequence[np.ndarray], dtype: str) -> nn.Module:
    """TorchRec's quantized inference ``EmbeddingBagCollection`` (FBGEMM's n-bit table-batched
    kernels) over fused quantized rows ``arrays`` (codes, then fp16 scale and bias)."""
    weights = {}
    for t, array in zip(tables, arrays):
        fused = torch.from_numpy(array)
        weights[t.name] = (fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:])
    data_type = DataType.INT8 if dtype == "int8" else DataType.INT4
    # Rows aligned to 4 bytes (FBGEMM's CPU kernels need no more): the default of 16 would pad
    # a 16-dim int8 row from 20 to 32 bytes.
    return QuantCollection(_configs(tables, data_type), is_weighted=False,
                           device=torch.device("cpu"), output_dtype=torch.float,
                           table_name_to_quantized_weights=weights,
                           row_alignment=QUANT_ROW_ALIGNMENT).eval()
