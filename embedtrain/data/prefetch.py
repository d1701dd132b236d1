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

Example:
    >>> squares = OrderedPrefetcher(range(10), lambda i: i * i, lambda xs: xs, num_workers=2)
    >>> list(squares)
    [0, 1, 4, 9, 16, 25, 36, 49, 64, 81]
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

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
