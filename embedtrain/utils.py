"""Small helpers shared by the training code, the synthetic-data generators and the data jobs.

Imports nothing of embedtrain (and nothing but the standard library and tqdm), so that any
module, torch-free ones included, can use it.

Example:
    >>> is_int(3, least=1), is_int(True), is_int(2.0)
    (True, False, False)
    >>> sorted(["part-10", "part-2"], key=natural_key)
    ['part-2', 'part-10']
    >>> first_line(ValueError("bad value\\nmore detail"))
    'bad value'
"""

from __future__ import annotations

import contextlib
import errno
import glob
import numbers
import os
import re
import signal
import sys
import tempfile
import threading
from typing import Any, Iterator, Optional, Sequence

from tqdm import tqdm

_DIGITS = re.compile(r"(\d+)")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type name if the message is empty."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def partial_path(out: "os.PathLike[str]") -> Any:
    """Where ``out`` is written before it is renamed into place: ``.NAME.tmp-PID`` beside it.
    Such files left by processes that are gone (a SIGTERM or SIGKILL mid-write) are removed."""
    from pathlib import Path

    out = Path(out)
    prefix = f".{out.name}.tmp-"
    for stale in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = stale.name[len(prefix):]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    return out.with_name(f"{prefix}{os.getpid()}")


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGINT that stopped a write (:func:`stop_on_signals`); ``path``: the output
    left unwritten. A ``KeyboardInterrupt``, so that ``except Exception`` blocks let it by."""

    def __init__(self, signum: int, path: Any = None) -> None:
        self.signum, self.path = signum, path
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (f"; {path} not written" if path else ""))


@contextlib.contextmanager
def stop_on_signals(path: Any = None) -> Iterator[None]:
    """Within it, a SIGTERM or SIGINT raises :class:`Stopped` (naming ``path``, the output
    being written) in the main thread, so that ``finally`` blocks remove partial files before
    the process exits; only the first signal raises (a second one does not interrupt that
    clean-up). The previous handlers are restored on leaving. Outside the main thread: a
    no-op (only it can handle signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Stopped(signum, path)

    signums = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


# errors about where bytes go, never about what is read
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` raised within, while ``path`` (a file or a directory) is written, names
    ``path`` unless it names ``path`` or a file under it already: one that names no file (a
    failed ``write``: a full disk, an I/O error), and a write error (no space, over quota, file
    too large, read-only file system) that names another file (``shutil.copyfile`` names its
    source; a partial file its hidden name). The output, not an input, is blamed."""
    try:
        yield
    except OSError as e:
        if not _names(e.filename, path) and (e.filename is None or e.errno in _WRITE_ERRNOS):
            e.filename, e.filename2 = os.fspath(path), None
        raise


def _names(filename: Any, path: str | os.PathLike) -> bool:
    """Whether ``filename`` (an ``OSError``'s) is ``path`` or lies under it."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    name, top = os.path.abspath(filename), os.path.abspath(path)
    return name == top or name.startswith(top.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def partial_output(out: "os.PathLike[str]") -> Iterator[Any]:
    """Writes the file ``out`` whole or not at all: yields its :func:`partial_path`, which the
    body writes and renames to ``out`` when complete. Whatever ends the body early -- an error,
    a SIGTERM or SIGINT (:class:`Stopped`, :func:`stop_on_signals`) -- the partial file is
    removed, and an ``OSError`` (a full disk) names ``out``, the file asked for, not the
    hidden partial one (:func:`writing`)."""
    with stop_on_signals(out):
        partial = partial_path(out)
        try:
            with writing(out):
                yield partial
        except OSError as e:
            if e.filename == os.fspath(partial):
                e.filename = os.fspath(out)
            raise
        finally:
            partial.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` whole or not at all: a temporary file beside it, fsynced, then
    renamed over it (a reader, or a process killed mid-write, never sees a partial file)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:
            e.filename = path  # a full disk names the file it was writing
        raise


def check_output_file(path: str | os.PathLike, option: str, example: str = "result.json",
                      inputs: Sequence[str | os.PathLike] = ()) -> None:
    """An output file named by ``option`` (e.g. ``--out``): to be (re)written, so not a directory,
    not under a file and none of the command's ``inputs`` (one-line ``ValueError`` otherwise,
    ``example`` the file name shown)."""
    shown = os.fspath(path)
    if os.path.isfile(shown):
        same = next((f for f in inputs if os.path.isfile(f) and os.path.samefile(f, shown)), None)
        if same is not None:
            raise ValueError(f"{shown}: is also an input ({os.fspath(same)}), which the output "
                             f"would replace; choose another {option}")
    if os.path.isdir(shown):
        raise ValueError(f"{shown}: is a directory; {option} names a file (e.g. "
                         f"{os.path.join(shown, example)})")
    parent = os.path.dirname(os.path.abspath(shown))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{shown}: lies under the file {parent}; choose another {option}")


def append_line(path: str | os.PathLike, line: str) -> None:
    """Appends one whole line (a single ``write`` of the line and its newline, fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
        os.fsync(fd)
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise
    finally:
        os.close(fd)


def is_int(value: Any, least: Optional[int] = None) -> bool:
    """Whether ``value`` is an integer (Python or NumPy), not a bool, and ``>= least`` if given.

    Config and JSON values and NumPy scalars alike: ``np.int64(3)`` is one, ``True``,
    ``np.bool_(True)``, ``3.0`` and ``"3"`` are not.
    """
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and (least is None or bool(value >= least)))


def natural_key(text: str | os.PathLike) -> list:
    """Sort key comparing the digit runs of ``str(text)`` as numbers (``day_2`` < ``day_10``)."""
    return [int(t) if t.isdigit() else t for t in _DIGITS.split(str(text))]


def progress_bar(total: Optional[int], desc: str, unit: str = "rows", disable: bool = False,
                 **kwargs: Any) -> tqdm:
    """A ``tqdm`` progress bar on stderr: ``done/total`` (or ``done`` if ``total`` is None) and
    the rate in ``unit``/s.

    On a terminal it redraws at most 10 times a second; in a log file (stderr not a terminal) at
    most every 10 s, plus the final state when it is closed. ``kwargs`` go to ``tqdm`` (e.g.
    ``bar_format``).
    """
    options: dict[str, Any] = dict(
        total=total, desc=desc, unit=f" {unit}", disable=disable, file=sys.stderr,
        dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10)
    options.update(kwargs)
    return tqdm(**options)


def phase_bar(total: Optional[int], desc: str, disable: bool = False) -> tqdm:
    """A :func:`progress_bar` counting a job's phases rather than rows.

    It reads ``desc: done/total phases [elapsed], <last phase>`` (``done phases`` if ``total`` is
    None); a finished phase is ``bar.set_postfix_str(name, refresh=False); bar.update()``.
    """
    counts = "{n}/{total}" if total is not None else "{n}"
    return progress_bar(total, desc, unit="phases", disable=disable,
                        bar_format="{desc}: " + counts + " phases [{elapsed}]{postfix}")


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first use.

    For package ``__init__`` files whose names need heavy imports (torch, torchrec), so that
    importing a light sibling module (an enum the config schema uses) does not pull them in.
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
