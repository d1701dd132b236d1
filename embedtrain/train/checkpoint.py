"""Atomic, retained checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``checkpoints/step_00001000/`` holding DCP shards of every rank plus
``trainer_state.json`` (step, epoch, loader position, ...). It is written under a hidden temporary
name and renamed only once complete, so a crash mid-write leaves the previous checkpoint usable and
no half-written one is ever picked up. Loading goes through DCP, never through pickle.

Failing safe: a save that fails on any rank (a full disk, an I/O error) removes its temporary
directory and raises :class:`CheckpointError` on every rank, one line naming the checkpoint and
the cause, the earlier checkpoints untouched. A checkpoint that cannot be read (a truncated shard,
a corrupt ``trainer_state.json``) is reported by :class:`CheckpointError` too; the trainer then
falls back to the next older one (:meth:`embedtrain.train.trainer.Trainer.restore`).

Loading runs no code from the checkpoint: DCP's ``FileSystemReader`` unpickles ``.metadata`` with
``pickle.load``, which calls whatever the pickle names. :class:`SafeFileSystemReader`, the only
reader embedtrain gives DCP (resume, eval, export), unpickles it with an allow-list of what DCP
writes there (its metadata classes, ``torch.Size``, dtypes, layouts, paths); anything else is
refused in one line naming the file before it is called. The shards (``*.distcp``) hold tensors
DCP reads with ``torch.load(weights_only=True)``.

Example:
    >>> ckpts = CheckpointManager(run_dir / "checkpoints", keep=2)
    >>> ckpts.save(100, {"model": model.state_dict()}, {"step": 100})
    >>> path = ckpts.latest(); info = ckpts.load(path, {"model": model.state_dict()})
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d{8,})$")
_STEP = re.compile(r"^(?:step_)?(\d+)$")  # how a user names a checkpoint: 500, step_00000500


# What a failed DCP read or write raises: DCP gathers the ranks' errors into a
# CheckpointException, which derives from BaseException, not Exception.
_FAILURES = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; ``str(err)`` is one line naming it."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another model (shapes or keys differ): no older one fits either."""


# What DCP's .metadata pickle may name (torch 2.13): its metadata classes, the file layout record,
# and the torch values inside them (Size; dtypes, layouts and memory formats by name; paths).
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside the allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None),
                                             (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never "
                                     f"holds (refused: unpickling it could run code)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` read through the allow-list (module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path, refused = self._get_metadata_path(kwargs.get("rank")), None
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                IndexError, KeyError) as e:
            refused = str(e) or type(e).__name__
        if refused is not None:  # raised outside the handler: the one line is the innermost
            raise CheckpointError(f"{path}: not a checkpoint's metadata: {refused}")
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a checkpoint's metadata (a "
                                  f"{type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _short_file(path: Path, metadata: Metadata) -> Optional[str]:
    """The first data file shorter than what ``.metadata`` says it holds (a truncated copy or an
    interrupted transfer), named; None when every file is long enough."""
    ends: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            held = "missing" if size is None else f"{size:,} bytes"
            return (f"{file}: truncated ({held}; {path.name}/.metadata says it holds "
                    f"{end:,}); copy the checkpoint again, or resume from an older one")
    return None


def describe_error(e: BaseException) -> str:
    """One line for a failed read or write, plain words for a full disk."""
    chain, seen = [e], set()
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        chain.append(nxt)
    text = " ".join(str(x) for x in chain)
    if any(getattr(x, "errno", None) == errno.ENOSPC for x in chain) or \
            "No space left" in text or "unexpected pos" in text:
        return "no space left on device"
    for x in chain:  # DCP wraps the rank's exception: show the innermost message
        failures = getattr(x, "failures", None)
        if failures:
            first = next(iter(failures.values()))
            inner = first[0] if isinstance(first, tuple) else first
            return _one_line(inner)
    return _one_line(chain[-1] if len(chain) > 1 else e)


def _one_line(e: BaseException) -> str:
    """The message's last line (a traceback's exception), up to its first sentence if long."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    if len(text) > 120 and ". " in text:
        text = text[: text.index(". ")]
    return f"{type(e).__name__}: {text}".rstrip(": ")


class CheckpointManager:
    """Saves and finds checkpoints under ``root``, keeping the newest ``keep`` (and ``pinned``).

    Args:
        root: the ``checkpoints/`` directory (created on first save).
        keep: how many complete checkpoints to retain (at least 1).
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.pinned: Optional[int] = None  # a step kept beside the newest (the best checkpoint)

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.root / f"step_{step:08d}"

    def save(self, step: int, state: dict[str, Any], trainer_state: dict[str, Any],
             rank_state: Optional[dict[str, torch.Tensor]] = None) -> Path:
        """Writes ``state`` (DCP, all ranks) and ``trainer_state`` (JSON, rank 0) as ``step``.

        ``rank_state`` (tensors that differ per rank, e.g. RNG states) goes to one file per rank.
        """
        final = self.path(step)
        tmp = self.root / f".tmp-step_{step:08d}"
        leader = _rank() == 0
        error: Optional[BaseException] = None
        if leader:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        if all_ranks_ok(error is None):  # a collective: every rank learns of the leader's failure
            try:
                dcp.save(state, checkpoint_id=tmp)  # collective: a failed rank fails them all
                if rank_state is not None:
                    torch.save(rank_state, tmp / _rank_file(_rank()))
                if leader:
                    _write_json(tmp / STATE_FILE, trainer_state)
            except _FAILURES as e:  # noqa: BLE001 - reported as one line below
                error = e
        if not all_ranks_ok(error is None):
            if leader:
                shutil.rmtree(tmp, ignore_errors=True)
            why = describe_error(error) if error is not None else "failed on another rank"
            raise CheckpointError(f"{final}: checkpoint not written: {why} (the partial one is "
                                  f"removed; earlier checkpoints are kept)")
        if leader:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def find(self, checkpoint: str | os.PathLike) -> Path:
        """The checkpoint a user named: a step (``500``, ``step_00000500``) or a directory.

        Raises:
            CheckpointError: no such checkpoint (the run's steps listed).
        """
        match = _STEP.match(str(checkpoint))
        path = self.path(int(match.group(1))) if match else Path(checkpoint)
        if not path.is_dir():
            steps = ", ".join(str(int(p.name.split("_")[1])) for p in self.all()) or "none"
            raise CheckpointError(f"{path}: no such checkpoint (steps of this run: {steps})")
        return path

    def remove_leftovers(self) -> int:
        """Removes what a killed run left: the temporary directories of its saves and prunes, and
        a checkpoint directory without its state file (a prune of an earlier version, killed
        half-way); returns how many."""
        if not self.root.is_dir():
            return 0
        left = [p for p in self.root.iterdir() if p.name.startswith(".tmp-")
                or (_NAME.match(p.name) and p.is_dir() and not (p / STATE_FILE).exists())]
        for p in left:
            shutil.rmtree(p, ignore_errors=True)
        return len(left)

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Optional[Path]:
        found = self.all()
        return found[-1] if found else None

    def info(self, path: str | os.PathLike) -> dict[str, Any]:
        """The checkpoint's trainer state (``trainer_state.json``).

        Raises:
            CheckpointError: missing, unreadable or not a JSON object (file named).
        """
        info_file = Path(path) / STATE_FILE
        if not info_file.is_file():
            raise CheckpointError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
        try:
            info = json.loads(info_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{info_file}: unreadable: {_one_line(e)}") from None
        if not isinstance(info, dict) or not isinstance(info.get("step"), int):
            raise CheckpointError(f"{info_file}: not a trainer state (no integer 'step')")
        return info

    def load(self, path: str | os.PathLike, state: dict[str, Any],
             missing_ok: tuple[str, ...] = (), grow_rows: bool = False) -> dict[str, Any]:
        """Loads into ``state`` in place (DCP) and returns the checkpoint's trainer state.

        Args:
            path: a complete checkpoint directory.
            state: the state dict to fill; sharded entries are resharded to this run's layout.
            missing_ok: key prefixes that may be absent from the checkpoint (they keep their
                current values): e.g. optimizer state of a table whose sharding moved to or from
                ``data_parallel``, whose state belongs to another optimizer.
            grow_rows: an entry saved with fewer rows than ``state``'s (a table and its optimizer
                state, grown for an extended vocabulary) fills its first rows; the others keep
                their current values (a fresh table's).

        Returns:
            The trainer state, plus ``"missing_keys"``: the entries left as they were.
        """
        path = Path(path)
        info = self.info(path)
        missing: list[str] = []
        try:  # first on its own: a refused .metadata is named as it is, not through DCP's retries
            metadata = SafeFileSystemReader(path).read_metadata()
            saved = set(metadata.state_dict_metadata)
        except CheckpointError:
            raise
        except _FAILURES as e:  # noqa: BLE001 - a truncated or corrupt .metadata
            raise CheckpointError(f"{path}: cannot read: {describe_error(e)}") from None
        if missing_ok:
            missing = [k for k in _flat_keys(state) if k not in saved]
            bad = [k for k in missing if not k.startswith(missing_ok)]
            if bad:
                raise ValueError(f"{path}: checkpoint lacks {bad[0]} (and {len(bad) - 1} more)")
        planner = DefaultLoadPlanner(allow_partial_load=bool(missing))
        grown = _grown_entries(state, metadata) if grow_rows else {}
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=planner)
            for target, old, where in grown.values():
                _copy_rows(old, target)
                set_element(state, where, target)
        except _FAILURES as e:  # noqa: BLE001 - DCP raises many kinds; one line for all
            why = describe_error(e)
            if "Size mismatch" in why or "Missing key" in why:
                raise CheckpointMismatch(f"{path}: does not fit this model ({why}); did the "
                                         f"model or the data set change?") from None
            raise CheckpointError(_short_file(path, metadata) or f"{path}: cannot read: {why}") \
                from None
        return {**info, "missing_keys": missing}

    @contextlib.contextmanager
    def reading(self, path: Optional[str | os.PathLike] = None) -> Iterator[Path]:
        """Keeps a checkpoint from being pruned while the block reads it (its path yielded).

        A shared ``flock`` on its ``trainer_state.json``: the pruner of a training run skips a
        checkpoint a reader holds (and removes it at a later save). Without ``path``, the
        newest complete checkpoint; one pruned between finding and pinning it is passed over.

        Raises:
            CheckpointError: ``path`` is not a complete checkpoint (or was just removed), or the
                run has none.
        """
        candidates = [Path(path)] if path is not None else self.all()[::-1]
        for ckpt in candidates:
            held = _pin(ckpt)
            if held is None:
                continue
            try:
                yield ckpt
            finally:
                os.close(held)
            return
        if path is not None:
            raise CheckpointError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
        raise CheckpointError(f"{self.root}: no complete checkpoint")

    def load_rank_state(self, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        """This rank's ``rank_state`` (rank 0's when saved by fewer ranks).

        Raises:
            CheckpointError: neither file is there (every save writes them: an incomplete copy,
                whose RNG state would be lost), or it cannot be read.
        """
        path = Path(path)
        for candidate in (path / _rank_file(_rank()), path / _rank_file(0)):
            if candidate.is_file():
                try:
                    return torch.load(candidate, weights_only=True)
                except _FAILURES as e:  # noqa: BLE001 - a truncated or corrupt file
                    raise CheckpointError(f"{candidate}: unreadable: {describe_error(e)}") from None
        raise CheckpointError(f"{path / _rank_file(0)}: missing (an incomplete checkpoint: its "
                              f"RNG state would be lost)")

    def _prune(self) -> None:
        pinned = self.path(self.pinned) if self.pinned is not None else None
        for old in self.all()[: -self.keep]:
            if old == pinned:
                continue
            try:
                fd = os.open(old / STATE_FILE, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a reader (eval, export) holds it: pruned at a later save
                os.close(fd)
                continue
            # Gone from view at once and whole (a rename), then deleted: a kill in between
            # leaves a temporary directory, which the next run removes.
            gone = self.root / f".tmp-pruned-{old.name}"
            os.replace(old, gone)
            os.close(fd)
            shutil.rmtree(gone, ignore_errors=True)


def _pin(ckpt: Path) -> Optional[int]:
    """A shared lock on ``ckpt``'s state file (its descriptor), or None when it is gone."""
    try:
        fd = os.open(ckpt / STATE_FILE, os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruner removes it
    try:
        alive = os.fstat(fd).st_ino == os.stat(ckpt / STATE_FILE).st_ino
    except OSError:
        alive = False
    if not alive:  # removed while we waited
        os.close(fd)
        return None
    return fd


def _flat_keys(state: dict[str, Any]) -> list[str]:
    """The fully qualified names DCP stores a nested state dict under."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return list(flatten_state_dict(state)[0])


def _grown_entries(state: dict[str, Any], metadata: Metadata
                   ) -> dict[str, tuple[Any, torch.Tensor, tuple]]:
    """The entries of ``state`` saved with fewer rows (the other dimensions equal), each swapped
    in ``state`` for a full tensor of the saved size that DCP fills: ``{key: (the target, that
    tensor, its place in state)}``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, places = flatten_state_dict(state)
    grown = {}
    for key, target in flat.items():
        saved = metadata.state_dict_metadata.get(key)
        if not isinstance(target, (torch.Tensor, ShardedTensor)) or not hasattr(saved, "size"):
            continue
        with warnings.catch_warnings():  # ShardedTensor.size(): "use DTensor" (TorchRec's)
            warnings.simplefilter("ignore", FutureWarning)
            old, new = tuple(saved.size), tuple(target.size())
        if len(old) == len(new) >= 1 and old[1:] == new[1:] and old[0] < new[0]:
            full = torch.zeros(old, dtype=saved.properties.dtype)
            grown[key] = (target, full, places[key])
            set_element(state, places[key], full)
    return grown


def _copy_rows(old: torch.Tensor, target: Any) -> None:
    """Copies the saved rows ``old`` into the first rows of ``target`` (its local shards)."""
    if not isinstance(target, ShardedTensor):
        target[:len(old)].copy_(old)
        return
    for shard in target.local_shards():
        offsets = shard.metadata.shard_offsets
        rows = max(0, min(shard.tensor.shape[0], len(old) - offsets[0]))
        if rows:
            block = old[offsets[0]:offsets[0] + rows]
            if shard.tensor.dim() > 1:
                block = block[:, offsets[1]:offsets[1] + shard.tensor.shape[1]]
            shard.tensor[:rows].copy_(block)


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective when distributed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def init_optimizer_state(optimizer: KeyedOptimizer) -> None:
    """Creates the lazy state of the non-fused optimizers, so a checkpoint can load in place."""
    children = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [("", optimizer)]
    for _, child in children:
        if isinstance(child, KeyedOptimizerWrapper):
            child.init_state()
