"""Background threads that load work items in parallel and assemble them in a fixed order.

:class:`OrderedPrefetcher` runs ``num_workers`` loader threads, worker ``w`` taking items
``w, w + num_workers, ...``, each into its own bounded queue, and one assembler thread that reads
the workers' queues round-robin (so results arrive in item order, whichever worker finishes
first) and feeds them through ``assemble`` into a bounded queue of ready outputs. The consumer
only dequeues.

Threads, not processes: Arrow decoding and NumPy release the GIL, and outputs stay zero-copy
(no pickling, no shared-memory staging). Shutdown is cooperative: ``close()``, the iterator being
garbage collected (a ``break`` out of the loop) or interpreter exit sets a stop flag and wakes
every blocked thread (blocking calls also poll the flag every 50 ms); threads end after the item
in progress and are joined. An exception in a thread is re-raised, unchanged, in the consumer, at
the position it happened.

:class:`IdleReadAhead` is for a consumer whose own work takes every core: the consumer loads in
its own thread, helped by one thread in the idle scheduling class that loads the next items on
CPU time nothing else wants, and never waits for it.

Example:
    >>> squares = OrderedPrefetcher(range(10), lambda i: i * i, lambda xs: xs, num_workers=2)
    >>> list(squares)
    [0, 1, 4, 9, 16, 25, 36, 49, 64, 81]
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")
Out = TypeVar("Out")

_POLL_S = 0.05  # how long a blocked thread waits before it looks at the stop flag again
_END = object()  # the assembler is done
_STOPPED = object()  # the iterator is closing (returned by _get, or put in a queue as a wake-up)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class OrderedPrefetcher(Generic[Out]):
    """An iterator over ``assemble(load(item) for item in items)``, computed in background threads.

    Args:
        items: work items (e.g. row groups), in the order their results must be assembled.
        load: runs in a worker thread per item (e.g. decode + validate + convert).
        assemble: runs in the assembler thread over the loaded results in item order and yields
            outputs (e.g. shuffle buffer + batch assembly).
        num_workers: loader threads (>= 1).
        max_ready: outputs that may wait for the consumer (bounds memory with ``max_loaded``).
        max_loaded: loaded results each worker may hold ahead of the assembler.
        name: prefix of the thread names.

    Returns:
        An iterator; iterate it, or ``close()`` it to stop early (a ``with`` block does too).
    """

    def __init__(
        self,
        items: Sequence[T],
        load: Callable[[T], R],
        assemble: Callable[[Iterable[R]], Iterable[Out]],
        num_workers: int = 1,
        max_ready: int = 8,
        max_loaded: int = 1,
        name: str = "embedtrain-loader",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for background loading, got {num_workers}")
        # Threads get these shared objects only, never `self`: an abandoned iterator can then be
        # garbage collected, and its finalizer stops them.
        self._stop = threading.Event()
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, max_ready))
        loaded = [queue.Queue(maxsize=max(1, max_loaded)) for _ in range(num_workers)]
        self._threads = [
            threading.Thread(target=_load_loop, name=f"{name}-worker{w}", daemon=True,
                             args=(items, w, num_workers, load, loaded[w], self._stop))
            for w in range(num_workers)
        ]
        self._threads.append(
            threading.Thread(target=_assemble_loop, name=f"{name}-assembler", daemon=True,
                             args=(len(items), loaded, assemble, self._ready, self._stop)))
        self._finished = False
        # Runs on close(), on garbage collection, or at interpreter exit (finalize's atexit hook),
        # so no thread is left decoding while the interpreter tears down the modules it uses.
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._threads,
                                           [*loaded, self._ready])
        for t in self._threads:
            t.start()

    def __iter__(self) -> "OrderedPrefetcher[Out]":
        return self

    def __next__(self) -> Out:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._threads[-1].is_alive() and self._ready.empty():
                    self.close()
                    raise RuntimeError("loader threads stopped without a result") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stops and joins the threads; safe to call more than once."""
        self._finished = True
        self._finalizer()

    def __enter__(self) -> "OrderedPrefetcher[Out]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shutdown(stop: threading.Event, threads: list[threading.Thread],
              queues: list[queue.Queue]) -> None:
    stop.set()
    # Wake threads blocked on a queue now rather than at their next poll: emptying a queue frees
    # its producer, a _STOPPED in it frees its consumer.
    for q in queues:
        while True:
            try:
                q.get_nowait()
            except queue.Empty:
                break
        try:
            q.put_nowait(_STOPPED)
        except queue.Full:
            pass
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=10.0)


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while not stop.is_set():
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            pass
    return _STOPPED


def _load_loop(items: Sequence[Any], worker: int, num_workers: int, load: Callable[[Any], Any],
               out: queue.Queue, stop: threading.Event) -> None:
    for position in range(worker, len(items), num_workers):
        if stop.is_set():
            return
        try:
            result = load(items[position])
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            _put(out, _Failure(e), stop)
            return
        if not _put(out, result, stop):
            return


def _assemble_loop(num_items: int, loaded: list[queue.Queue],
                   assemble: Callable[[Iterable[Any]], Iterable[Any]], ready: queue.Queue,
                   stop: threading.Event) -> None:
    def in_order() -> Iterator[Any]:
        for position in range(num_items):
            result = _get(loaded[position % len(loaded)], stop)
            if result is _STOPPED:
                return
            if isinstance(result, _Failure):
                raise result.error
            yield result

    try:
        for output in assemble(in_order()):
            if not _put(ready, output, stop):
                return
        if not stop.is_set():
            _put(ready, _END, stop)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
        _put(ready, _Failure(e), stop)


class IdleReadAhead(Generic[R]):
    """``load(item)`` for each item, in order, in the consumer's thread, with loads done ahead by
    one background thread that only gets CPU time nothing else wants.

    For a consumer whose own work takes every core (a CPU training step on all its threads):
    there a background loader can only run by preempting the step, whose other threads then wait
    for it at their next barrier. This thread runs in Linux's ``SCHED_IDLE`` class instead, so it
    gets a core only while the step leaves one idle, and it loads at most ``ahead`` items past the
    consumer's position. The consumer never waits for it: an item it has not finished (a busy
    machine can starve it indefinitely) the consumer loads itself, and the thread's copy is
    dropped. ``load`` must therefore be a pure function of its item (results are equal whoever
    computes them), and its errors surface in the consumer, at their position, as without the
    thread. Where ``SCHED_IDLE`` is not available (not Linux), no thread is started.

    Args:
        items: work items, in order.
        load: a pure function of an item.
        ahead: items the thread may hold loaded past the consumer's position.
        background_load: the thread's variant of ``load`` (e.g. without helper threads of its
            own, which would run at normal priority), giving equal results; default ``load``.
        name: the thread's name.
    """

    def __init__(self, items: Sequence[T], load: Callable[[T], R], ahead: int = 2,
                 background_load: Optional[Callable[[T], R]] = None,
                 name: str = "embedtrain-read-ahead") -> None:
        self._items, self._load = items, load
        self._state = _AheadState(max(1, ahead))
        self._thread = None
        if _can_idle() and len(items) > 1:
            # Not a daemon: at interpreter exit the load in progress ends first (a native
            # decoder torn down under a running thread aborts the process).
            self._thread = threading.Thread(target=_read_ahead_loop, name=name,
                                            args=(items, background_load or load, self._state))
            self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_ahead, self._state)

    def __iter__(self) -> Iterator[R]:
        state = self._state
        try:
            for position, item in enumerate(self._items):
                with state.cond:
                    taken = state.done.pop(position, None)
                    state.position = position + 1  # the thread drops its copy of this one
                    state.cond.notify_all()
                if taken is None:
                    yield self._load(item)
                else:
                    state.taken_ahead += 1
                    yield taken.value
        finally:
            self.close()

    def close(self) -> None:
        """Stops the thread (it ends after the load in progress); safe to call more than once."""
        self._finalizer()

    @property
    def loaded_ahead(self) -> int:
        """Items the thread loaded that the consumer took (for tests and benchmarks)."""
        return self._state.taken_ahead


class _AheadState:
    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.cond = threading.Condition()
        self.done: dict[int, Any] = {}  # position -> result, loaded by the thread
        self.position = 0  # the consumer's next position; the thread loads from here on
        self.stopped = False
        self.taken_ahead = 0


def _can_idle() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


def _read_ahead_loop(items: Sequence[Any], load: Callable[[Any], Any], state: _AheadState) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only (Linux)
    except OSError:
        return  # the consumer loads everything itself
    while True:
        with state.cond:
            while True:
                # the main thread gone: the interpreter is exiting, with this iterator unclosed
                if state.stopped or not threading.main_thread().is_alive():
                    return
                todo = next((p for p in range(state.position,
                                              min(len(items), state.position + state.ahead))
                             if p not in state.done), None)
                if todo is not None:
                    break
                if state.position >= len(items):
                    return
                state.cond.wait(_POLL_S)
        try:
            result = load(items[todo])
        except BaseException:  # noqa: BLE001 - the consumer loads it again and raises it there
            return
        with state.cond:
            if todo >= state.position:  # else the consumer has loaded it itself
                state.done[todo] = _Taken(result)
            state.cond.notify_all()


class _Taken:
    """A result of the read-ahead thread (so that a ``None`` result is a result)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _stop_ahead(state: _AheadState) -> None:
    # Not joined: the thread ends after the load in progress, which at idle priority may wait
    # long for a core; the consumer does not wait for it.
    with state.cond:
        state.stopped = True
        state.done.clear()
        state.cond.notify_all()
