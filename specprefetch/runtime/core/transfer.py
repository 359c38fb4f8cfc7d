"""Background expert transfers: a prioritised queue served by I/O worker threads that overlap with compute.

The I/O order is the storage profile's (``device.io_order``):

- ``demand_first`` (default): demand loads (an executing layer needs the expert now) go before prefetches: no
  prefetch starts while a demand load is queued or running (one already under way is not interrupted), and at a
  ``bandwidth``-emulated device a demand request overtakes prefetches still waiting for bandwidth. A prefetch that
  has not started when its target layer begins and is needed there is promoted to a demand load.
- ``fifo``: every load is served in the order it was issued; a demand load waits for the prefetches queued before
  it (the ones the layer needs keep their place, nothing is promoted).

Either way prefetches keep the order they were issued in (descending predicted priority), and a prefetch that has
not started when its target layer begins and is not needed there is cancelled.

Workers serve prefetches (and, under ``fifo``, a demand load behind them); a demand load at the head of the
queue (under ``demand_first`` every demand load, and prefetches promoted before they started; under ``fifo`` one
whose earlier loads have all started, also when the layer was already waiting for them to) is performed by the
compute thread itself (:meth:`TransferEngine.steal`) when the layer needs it: the layer blocks on it either way, and
it then costs no thread hand-off, as in a plain on-demand runtime (measured: a hand-off to a woken worker added
~0.5 ms per load on a loaded 2-core host, more than the read itself).

A worker reads the record from storage (:class:`~specprefetch.runtime.core.storage.ExpertReader`) into the cache
slot (CPU: a page-cache or RAM read straight into it, a direct read through one of the reader's shared staging
buffers), or into a pinned staging buffer and then, on the worker's own CUDA stream, into the GPU slot
(CUDA); the transfer is complete when the copy has finished. A failed read is retried ``retries`` times;
a transfer that still fails releases its slot, so the expert is loaded again on demand when it is needed and
a wrong or partial expert is never used.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specprefetch.runtime.core.cache import ExpertCache, Key, SlotPool
from specprefetch.runtime.core.storage import ExpertReader

log = logging.getLogger(__name__)

DEMAND, PREFETCH = 0, 1


def queue_order(tr: Any, fifo: bool) -> tuple[int, int]:
    """A queued transfer's place: demand loads first, then in issue order; under FIFO in issue order only."""
    return (0, tr.seq) if fifo else (tr.cls, tr.seq)


def worker_ready(pending: list[Any], fifo: bool, demand_outstanding: bool) -> list[Any]:
    """The queued transfers an idle worker may take: under ``demand_first`` prefetches only, none while a demand
    load is outstanding; under FIFO any (the oldest first)."""
    if fifo:
        return list(pending)
    return [] if demand_outstanding else [t for t in pending if t.cls == PREFETCH]


def overtakes(tr: Any, pending: list[Any]) -> bool:
    """Under FIFO: performing ``tr`` now would overtake a transfer issued before it that has not started."""
    return any(t.seq < tr.seq for t in pending)


@dataclass(eq=False)
class Transfer:
    """One expert transfer and its timeline (perf_counter seconds)."""

    key: Key
    kind: str                 # "demand" or "prefetch" (as issued)
    step: int
    seq: int
    cls: int = PREFETCH       # DEMAND after a promotion
    state: str = "pending"    # pending, running, done, failed, cancelled
    t_submit: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0
    attempts: int = 0
    error: str | None = None
    inline: bool = False      # performed by the compute thread (a stolen demand load)
    unneeded: bool = False    # a prefetch its target layer did not need: evict it first once it arrives
    charged: bool = True      # emulated storage delay applies (False: issued during prefill, which is not timed)
    t_woken: float = 0.0      # the compute thread woke after waiting for it to finish (0: nobody blocked on it)
    t_offered: float = 0.0    # an idle worker was first told it could take it (the notify; 0: never offered)
    woke: bool = False        # the worker that started it was asleep when it was offered: t_start - t_offered is
                              # that worker's wake-up (a thread hand-off the disk's service time does not hold)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")


class TransferEngine:
    """The I/O worker pool. All queue/cache mutations happen under ``cache.lock`` (one lock, no ordering issues).
    The per-layer loop's wall-clock :class:`~specprefetch.runtime.core.iobackend.IOBackend`."""

    def __init__(self, reader: ExpertReader, cache: ExpertCache, pool: SlotPool, n_workers: int = 4,
                 retries: int = 2) -> None:
        self.reader = reader
        self.cache = cache
        self.pool = pool
        self.retries = int(retries)
        self.fifo = not reader.profile.demand_first
        self.cond = threading.Condition(cache.lock)       # transfers finished (waiters: compute thread)
        self.work = threading.Condition(cache.lock)       # work queued (waiters: idle workers)
        self.pending: list[Transfer] = []
        self.active: dict[Key, Transfer] = {}
        self.log: list[Transfer] = []
        self.io_errors = 0
        self._seq = itertools.count()
        self._stop = False
        self.cuda = pool.device.type == "cuda"
        self.charge_delays = True  # the runtime clears it during prefill steps (see Transfer.charged)
        self.workers = [threading.Thread(target=self._work, args=(i,), name=f"expert-io-{i}", daemon=True)
                        for i in range(max(1, int(n_workers)))]
        for w in self.workers:
            w.start()

    # -------------------------------------------------------------- the clock (IOBackend)
    def now(self) -> float:
        """The wall clock (``time.perf_counter``)."""
        return time.perf_counter()

    def account(self, seconds: float) -> None:
        """Nothing to charge: on the wall clock the compute took its time already."""

    def poll(self) -> None:
        """Nothing to settle: the I/O threads finish their transfers themselves."""

    # -------------------------------------------------------------- control (caller holds no lock or cache.lock)
    def submit(self, key: Key, kind: str, step: int) -> Transfer:
        """Queue a transfer of ``key`` into its reserved slot (the caller reserved it under ``cache.lock``)."""
        with self.cond:
            tr = Transfer(key, kind, step, next(self._seq), DEMAND if kind == "demand" else PREFETCH,
                          t_submit=time.perf_counter(), charged=self.charge_delays)
            self.pending.append(tr)
            self.active[key] = tr
            self.log.append(tr)
            if kind != "demand":
                self._offer(tr.t_submit, again=False)
                self.work.notify()
            return tr

    def inflight(self, key: Key) -> Transfer | None:
        with self.cond:
            return self.active.get(key)

    def promote(self, key: Key) -> None:
        """A queued prefetch the executing layer needs becomes a demand load (goes first); under FIFO it keeps its
        place."""
        with self.cond:
            tr = self.active.get(key)
            if tr is not None and tr.cls != DEMAND and not self.fifo:
                tr.cls = DEMAND

    def cancel_pending(self, layer: int, keep: set[int]) -> list[Transfer]:
        """Cancel queued (not started) prefetches for ``layer`` whose expert is not in ``keep``."""
        out = []
        with self.cond:
            for tr in list(self.pending):
                if tr.key[0] == layer and tr.cls == PREFETCH and tr.key[1] not in keep:
                    self.pending.remove(tr)
                    self._finish(tr, "cancelled", None)
                    out.append(tr)
        return out

    def steal(self, key: Key) -> Transfer | None:
        """Claim the not-yet-started transfer of ``key`` for the calling thread (None if none is pending)."""
        with self.cond:
            tr = self.active.get(key)
            if tr is None or not self.claimable(tr):
                return None
            self.pending.remove(tr)
            tr.state = "running"
            tr.t_start = tr.t_start or time.perf_counter()
            tr.inline = True
            return tr

    def execute(self, tr: Transfer) -> None:
        """Perform a claimed transfer on the calling thread (compute stream on CUDA), retrying failed reads."""
        slot = self.cache.slot(tr.key)
        while True:
            error = _read_error(self._load, tr, slot)
            with self.cond:
                if self._settle(tr, error):
                    return

    def wait_any(self, timeout: float = 5.0) -> bool:
        """Make progress on the queue: wait until a running transfer finishes, or, if none is running, perform
        the best queued one on this thread. False if nothing is queued or running."""
        with self.cond:
            if not self.active:
                return False
            running = any(tr.state == "running" for tr in self.active.values())
            if running:
                self.cond.wait(timeout)
                return True
            tr = min(self.pending, key=lambda t: queue_order(t, self.fifo))
        if self.steal(tr.key) is tr:
            self.execute(tr)
        return True

    def claimable(self, tr: Any) -> bool:
        """Under the lock: the queued ``tr`` may be claimed now (:meth:`steal`): under FIFO only once every load
        issued before it has started."""
        return tr.state == "pending" and not (self.fifo and overtakes(tr, self.pending))

    def wait(self, tr: Transfer) -> None:
        """Block until ``tr`` has finished (done, failed or cancelled), or, queued under FIFO behind loads issued
        before it, until they have all started: then the caller claims it (:meth:`steal`) rather than wait for a
        worker to come free. When the caller did block and ``tr`` is done, ``tr.t_woken`` is when it ran again:
        ``t_woken - t_end`` is the hand-off from the worker that finished it back to the waiting thread (a wake-up
        that waits for a core the I/O workers hold on a small host)."""
        with self.cond:
            blocked = not tr.finished
            while not tr.finished and not (self.fifo and self.claimable(tr)):
                self.cond.wait()
            if blocked and tr.state == "done":
                tr.t_woken = time.perf_counter()

    def drain(self) -> None:
        """Wait until no transfer is queued or running (the simulator-matching synchronous mode)."""
        while self.wait_any(1.0):
            pass

    def shutdown(self) -> None:
        with self.cond:
            self._stop = True
            for tr in self.pending:
                self._finish(tr, "cancelled", None)
            self.pending.clear()
            self.cond.notify_all()
            self.work.notify_all()
        for w in self.workers:
            w.join(timeout=10)

    def reset_log(self) -> None:
        with self.cond:
            self.log = [tr for tr in self.log if not tr.finished]
            self.io_errors = 0

    # -------------------------------------------------------------- workers
    def _finish(self, tr: Transfer, state: str, error: str | None) -> None:
        """Under the lock: settle a transfer and its slot, wake waiters."""
        tr.state = state
        tr.error = error
        tr.t_end = time.perf_counter()
        if self.active.get(tr.key) is tr:
            del self.active[tr.key]
        if state == "done":
            self.cache.fill(tr.key)
            if tr.unneeded:
                self.cache.demote(tr.key)
        else:
            self.cache.cancel(tr.key)
        self.cond.notify_all()
        if tr.cls == DEMAND:  # prefetches held back by this demand load may start
            self._offer(tr.t_end, again=not self.fifo)
            self.work.notify_all()

    def _offer(self, now: float, again: bool) -> None:
        """Under the lock, before a notify of the workers: the queued transfers are offered to them from ``now``
        (``again``: also those offered before, held back since by a demand load)."""
        for t in self.pending:
            if again or not t.t_offered:
                t.t_offered = now

    def demand_outstanding(self) -> bool:
        """Under the lock: a demand load (or a promoted prefetch) is queued or running."""
        return any(tr.cls == DEMAND for tr in self.active.values())

    def _next(self) -> Transfer | None:
        with self.cond:
            slept = 0.0  # when this worker fell asleep waiting for work (0: it found work at once)
            while not self._stop:
                ready = worker_ready(self.pending, self.fifo, self.demand_outstanding())
                if ready:
                    break
                slept = slept or time.perf_counter()
                self.work.wait()
            if self._stop:
                return None
            tr = min(ready, key=lambda t: t.seq)
            self.pending.remove(tr)
            tr.state = "running"
            if self.fifo:  # a load queued behind this one may now be claimed by the thread waiting for it
                self.cond.notify_all()
            if not tr.t_start:
                tr.t_start = time.perf_counter()
                tr.woke = bool(slept) and tr.t_offered >= slept
            return tr

    def _work(self, index: int) -> None:
        stream = None
        if self.cuda:
            torch.cuda.set_device(self.pool.device)
            stream = torch.cuda.Stream(device=self.pool.device)
        while True:
            tr = self._next()
            if tr is None:
                return
            slot = self.cache.slot(tr.key)
            error = _read_error(self._load, tr, slot, stream)
            with self.cond:
                if not self._settle(tr, error):  # a retry: back in the queue for any worker
                    log.debug("retrying expert %s after I/O error: %s", tr.key, error)
                    tr.state = "pending"
                    self.pending.append(tr)
                    tr.t_offered = time.perf_counter()
                    self.work.notify()

    def _settle(self, tr: Transfer, error: str | None) -> bool:
        """Under ``self.cond``: count one attempt of ``tr``; finish it when it succeeded or has no retry left (or the
        engine is stopping). True when finished, False when it should be tried again."""
        tr.attempts += 1
        if error is None:
            self._finish(tr, "done", None)
            return True
        self.io_errors += 1
        if tr.attempts > self.retries or self._stop:
            log.warning("expert %s: transfer failed after %d attempts: %s", tr.key, tr.attempts, error)
            self._finish(tr, "failed", error)
            return True
        return False

    def _load(self, tr: Transfer, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Bring ``tr``'s record into ``slot``: on CPU through :meth:`ExpertReader.load`; on CUDA from the RAM mirror or
        a staging buffer (:meth:`ExpertReader.staging`), copied to the GPU on ``stream`` (a worker's: after the
        slot's last reader, then synchronised) or, with no stream (the compute thread's own load), synchronously on
        the current stream. A load the compute thread performs is a demand load."""
        layer, expert = tr.key
        dest = self.pool.record(slot)
        kw = {"charged": tr.charged, "demand": tr.inline or tr.cls == DEMAND}
        if not self.cuda:
            self.reader.load(layer, expert, dest, self.pool.buffer(slot), **kw)
            return
        src = self.reader.source(layer, expert)
        if src is not None:
            _to_device(src, dest, self.pool.events[slot], stream)
            return
        with self.reader.staging() as buf:
            self.reader.read(layer, expert, buf, **kw)
            _to_device(buf, dest, self.pool.events[slot], stream)


def _to_device(src: torch.Tensor, dest: torch.Tensor, used: torch.cuda.Event | None,
               stream: torch.cuda.Stream | None) -> None:
    """Copy a host record into its GPU slot: synchronously on the current stream, or on ``stream`` once the kernels
    that last read the slot (event ``used``) are done, waiting for the copy (the host buffer is reused after it)."""
    if stream is None:
        dest.copy_(src)
        return
    with torch.cuda.stream(stream):
        if used is not None:
            stream.wait_event(used)
        dest.copy_(src, non_blocking=True)
    stream.synchronize()


def _read_error(copy: Callable[..., None], *args: Any) -> str | None:
    """Run one read-and-copy attempt; the OS error it raised, as text, or None when it succeeded."""
    try:
        copy(*args)
    except OSError as exc:
        return str(exc)
    return None
