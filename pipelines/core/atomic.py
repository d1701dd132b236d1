"""Data set folders that appear whole or not at all: a temporary folder beside ``--out``.

:func:`atomic_output` is how ``embedtrain ingest`` and ``embedtrain datagen`` write: the job
writes into ``.<name>.tmp-<host>-<pid>`` beside ``--out`` (the same parent, so the same file
system), holding an ``flock`` on it; when the job returns, every file in it is fsynced and the
folder takes ``--out``'s place. An earlier data set at ``--out`` is swapped with the new one in one
step (``renameat2(RENAME_EXCHANGE)``) where the file system has it, else renamed aside to
``.<name>.old-<host>-<pid>`` and the new one renamed in (``--out`` is missing only between those
two renames); then the old one is deleted. So ``--out`` always holds a complete data set, the
earlier one or the new one.

A job that fails removes its folder (and the earlier data set stays); a killed job leaves it, and
the next job for the same ``--out`` removes it, saying so in one line: a folder of ours whose
writer is dead (same host, its pid gone, or its lock free). An ``.old-`` folder is put back when
``--out`` is missing (a kill between the two renames). A folder whose writer is alive refuses the
new job (one writer per ``--out``); one written from another host is left, with a note.

An interrupt (Ctrl-C: a ``KeyboardInterrupt``, which Polars raises too when SIGINT arrives while
it runs) is a failure like any other, raised as :class:`Interrupted` (a ``KeyboardInterrupt``
that says whether the new data set had already taken ``--out``'s place). The clean-up it starts
is not cut short by a second one (Polars' ``KeyboardInterrupt`` is followed by Python's own for
the same signal, wherever the interpreter next checks): it runs again from the start.

A full disk (or another ``OSError`` writing the output) ends in one line naming ``--out``
(:class:`OutputError`). Messages, ``stderr`` lines and the JSON files written during the job show
``--out``, not the temporary folder.

Stdlib only (no Polars): ``embedtrain datagen`` uses it through :mod:`pipelines`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from embedtrain.utils import pid_alive
from pipelines.core.errors import IngestError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS: pids alone tell a live writer
    fcntl = None  # type: ignore[assignment]

_FULL = (errno.ENOSPC, errno.EDQUOT)
_WRITE = (errno.EROFS, errno.EFBIG)  # OSErrors that only a write raises (and _FULL)
_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
GRACE_S = 30.0  # a live pid's folder this young may not hold its lock yet
_DATA_FILE = re.compile(r".+\.(parquet|npy)(\.tmp)?")  # what a data set's subfolders hold


class OutputError(IngestError):
    """The output cannot be written (a full disk, no permission, a live writer): one line
    naming ``--out``."""


class Interrupted(KeyboardInterrupt):
    """A job interrupted while writing ``out`` (``--out`` as given): ``published`` says whether
    the new data set had already replaced it (it is then complete); if not, ``out`` holds what it
    held before, and the temporary folder is gone."""

    def __init__(self, out: str, published: bool) -> None:
        super().__init__(out, published)
        self.out, self.published = out, published


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def foreign_entries(out: Path, names: Mapping[str, bool | str], files: Sequence[str] = ()
                    ) -> list[str]:
    """The entries of folder ``out`` that a job did not write, sorted: ``names`` maps each name a
    job writes to whether it is a folder (``True``: its entries must be ``.parquet``/``.npy``
    files; a string: the pattern its entries' names must match); ``files``: patterns of more
    file names at the top."""
    foreign = []
    for p in out.iterdir():
        if p.name in names and names[p.name] and p.is_dir() and not p.is_symlink():
            pattern = _DATA_FILE if names[p.name] is True else re.compile(names[p.name])
            if all(c.is_file() and pattern.fullmatch(c.name) for c in p.iterdir()):
                continue
        elif p.name in names and not names[p.name] and p.is_file():
            continue
        elif any(re.fullmatch(f, p.name) for f in files) and p.is_file():
            continue
        foreign.append(p.name + ("/" if p.is_dir() else ""))
    return sorted(foreign)


class Staging:
    """The temporary folder of one job (``path``) and the ``--out`` it becomes (``out``, shown
    as ``display``)."""

    def __init__(self, out: Path, display: str, path: Path) -> None:
        self.out, self.display, self.path = out, display, path

    def unmask(self, value: Any) -> Any:
        """``value`` (a str, or dicts and lists of them) with the temporary path shown as
        ``--out``."""
        if isinstance(value, str):
            return value.replace(str(self.path), self.display)
        if isinstance(value, dict):
            return {k: self.unmask(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.unmask(v) for v in value]
        return value


@contextlib.contextmanager
def atomic_output(out: str | os.PathLike, refusal: Callable[[Path], Optional[str]], *,
                  job: str, complete: Sequence[str] = ("metadata.json",)) -> Iterator[Staging]:
    """Yields the :class:`Staging` a job writes into; on a normal exit it becomes ``out``.

    Args:
        out: ``--out``.
        refusal: for an existing non-empty ``out``: why it may not be replaced (the end of a
            one-line message), or None.
        job: the command, in messages (``ingest``, ``datagen``).
        complete: file names one of which a finished data set holds.

    Raises:
        OutputError: ``out`` is a file or lies under one, ``refusal`` refuses it, another job is
            writing it, or writing failed (a full disk, no permission); the earlier data set at
            ``out`` is then untouched.
    """
    display = str(Path(out))
    target = Path(os.path.abspath(out))
    if target.is_symlink():
        target = Path(os.path.realpath(target))  # the link stays; its folder is replaced
    try:
        _check_place(target, display)
        _clean_leftovers(target, display, job)
        earlier = target.is_dir() and any(target.iterdir())
        if earlier and (why := refusal(target)):
            raise OutputError(f"{display}: {why}")
    except OSError as e:
        raise OutputError(f"{display}: cannot write the data set: {_reason(e)}") from None
    missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    staging = Staging(target, display,
                      target.parent / f".{target.name}.tmp-{_host()}-{os.getpid()}")
    aside = f".{target.name}.old-{_host()}-{os.getpid()}"
    lock, stderr, made = None, sys.stderr, None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.path.mkdir()
        made = _identity(staging.path)  # --out is this folder once the job is published
        lock = _lock(staging.path)
        sys.stderr = _Unmasked(stderr, str(staging.path), display)  # the job's warnings, bars
        try:
            yield staging
        finally:
            sys.stderr = stderr
        if not any((staging.path / name).is_file() for name in complete):
            raise OutputError(f"{display}: the {job} ended without writing {complete[0]}; "
                              "nothing was changed")
        _check_place(target, display)  # again: --out may have changed while the job ran
        if target.is_dir() and any(target.iterdir()) and (why := refusal(target)):
            raise OutputError(f"{display}: {why}")
        _unmask_json(staging)
        _fsync_tree(staging.path)
        old = _publish(staging.path, target, aside)
        with contextlib.suppress(OSError):  # in place: a folder without fsync is no failure
            _fsync(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        published = _despite_interrupts(_discard, staging.path, target.parent / aside, target,
                                        made, missing)
        if isinstance(e, KeyboardInterrupt):
            raise _despite_interrupts(Interrupted, display, published) from None
        raise _translated(e, staging, earlier) from None
    finally:
        if lock is not None:
            os.close(lock)


def _check_place(target: Path, display: str) -> None:
    if target.exists() and not target.is_dir():
        raise OutputError(f"{display}: exists and is not a directory; choose another --out")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                shown = parent if Path(display).is_absolute() else os.path.relpath(parent)
                raise OutputError(f"{display}: {shown} is a file, not a directory; choose "
                                  "another --out")
            return


def _clean_leftovers(target: Path, display: str, job: str) -> None:
    """Removes the folders of dead writers of ``target`` (one line on stderr); refuses a live
    one."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-([\w.]+)-(\d+)")
    removed, notes = [], []
    for entry in sorted(target.parent.iterdir()):
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink():
            continue
        kind, host, pid = m.group(1), m.group(2), int(m.group(3))
        state = _writer(entry, host, pid)
        if state == "live":
            raise OutputError(f"{display}: another {job} is writing it (pid {pid} on {host}, "
                              f"into {entry.name}); wait for it to end or choose another --out")
        if state == "unknown":
            notes.append(f"left {entry.name} (written on host {host}: remove it if that job "
                         "is gone)")
        elif kind == "old" and not os.path.lexists(target):
            os.rename(entry, target)  # killed between the two renames: the earlier data set
            removed.append(f"put {entry.name} back as {display}")
        else:
            shutil.rmtree(entry)
            removed.append(f"removed {entry.name}")
    if removed or notes:
        what = "; ".join(removed + notes)
        print(f"embedtrain {job}: leftovers of an interrupted {job} beside {display}: {what}",
              file=sys.stderr)


def _writer(entry: Path, host: str, pid: int) -> str:
    """``live``, ``dead`` or ``unknown``: the state of the job that wrote ``entry``."""
    locked = _locked(entry)
    if host != _host():
        return "live" if locked else "unknown"  # another host's pid means nothing here
    if pid == os.getpid() or not pid_alive(pid):
        return "live" if locked else "dead"
    if locked is False and time.time() - entry.stat().st_mtime > GRACE_S:
        return "dead"  # the pid was reused by another process
    return "live"


def _lock(path: Path) -> Optional[int]:
    """An fd of ``path`` holding its exclusive ``flock`` (None where there is no flock)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without flock: the pid still says
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _locked(path: Path) -> Optional[bool]:
    """Whether another open file holds ``path``'s flock; None: cannot tell."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # and with it the lock just taken
    return False


def _publish(tmp: Path, target: Path, aside_name: str) -> Optional[Path]:
    """Moves ``tmp`` to ``target``; returns where the earlier ``target`` now is (to delete)."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return None
    if _exchange(tmp, target):
        return tmp
    aside = target.parent / aside_name
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        _despite_interrupts(_put_back, aside, target)
        raise
    return aside


def _put_back(aside: Path, target: Path) -> None:
    if os.path.lexists(aside) and not os.path.lexists(target):
        os.rename(aside, target)


def _discard(staging: Path, aside: Path, target: Path, made: Optional[tuple[int, int]],
             parents: Sequence[Path]) -> bool:
    """Clears up after a job that failed or was interrupted; returns whether ``target`` holds
    its new data set (``made``: the identity of the job's temporary folder) all the same.

    Removed: the temporary folder (after a swap, the earlier data set); the earlier data set
    renamed aside, once ``target`` holds the new one (else it is put back); the ``parents`` made
    for ``target`` (innermost first; only those left empty) unless ``target`` is there."""
    published = made is not None and _identity(target) == made
    if published:
        shutil.rmtree(aside, ignore_errors=True)
    else:
        _put_back(aside, target)
    shutil.rmtree(staging, ignore_errors=True)
    for p in () if published else parents:
        with contextlib.suppress(OSError):
            p.rmdir()
    return published


def _despite_interrupts(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run again from the start when a ``KeyboardInterrupt`` cuts it short: a
    clean-up that must finish (``fn`` may be run more than once)."""
    while True:
        try:
            return fn(*args)
        except KeyboardInterrupt:
            continue


def _identity(path: Path) -> Optional[tuple[int, int]]:
    """The device and inode of folder ``path`` (None if it is missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _exchange(a: Path, b: Path) -> bool:
    """Swaps ``a`` and ``b`` in one step (Linux ``renameat2``); False where it cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2
    return fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # no fsync of a folder
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and folder under ``root`` on disk (a write error that surfaces only now, such
    as a full disk with delayed allocation, is raised here, before anything is replaced)."""
    for folder, _, names in os.walk(root):
        for name in names:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _unmask_json(staging: Staging) -> None:
    """The top-level JSON files (report, metadata) with ``--out`` for the temporary path."""
    old, new = json.dumps(str(staging.path))[1:-1], json.dumps(staging.display)[1:-1]
    for path in staging.path.glob("*.json"):
        text = path.read_text()
        if old in text:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text.replace(old, new))
            os.replace(tmp, path)


def _translated(e: BaseException, staging: Staging, earlier: bool) -> BaseException:
    """The error to raise for ``e``: one line naming ``--out`` for a write failure, the same
    error with ``--out`` for the temporary path otherwise."""
    kept = " (the earlier data set there is kept)" if earlier else ""
    if isinstance(e, OutputError):
        return e
    if _full_disk(e):
        return OutputError(f"{staging.display}: cannot write the data set: no space left on "
                           f"device{kept}")
    names = [os.fsdecode(n) for n in (getattr(e, "filename", None),
                                      getattr(e, "filename2", None)) if n]
    if isinstance(e, OSError) and (e.errno in _WRITE or any(
            n.startswith(str(staging.path)) or n == str(staging.out) for n in names)):
        return OutputError(f"{staging.display}: cannot write the data set: {_reason(e)}{kept}")
    if isinstance(e, Exception) and len(e.args) == 1 and isinstance(e.args[0], str) \
            and str(staging.path) in e.args[0]:
        with contextlib.suppress(Exception):
            return type(e)(staging.unmask(e.args[0]))
    return e


def _full_disk(e: Optional[BaseException]) -> bool:
    """Whether ``e`` or an error it came from is a full disk (an OSError, or Polars' text)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if any(t in str(e) for t in _FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


class _Unmasked:
    """A text stream that shows the temporary path as ``--out``."""

    def __init__(self, stream: Any, old: str, new: str) -> None:
        self._stream, self._old, self._new = stream, old, new

    def write(self, text: str) -> int:
        return self._stream.write(text.replace(self._old, self._new)
                                  if isinstance(text, str) else text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
