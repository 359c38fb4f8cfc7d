"""The I/O backend the per-layer loop (:mod:`~specprefetch.runtime.core.layer`) drives: one interface, two clocks.

:class:`~specprefetch.runtime.core.transfer.TransferEngine` serves transfers with I/O threads on the wall clock; the
simulator's ``_SimIO`` (:mod:`~specprefetch.runtime.simulation.simulator`) serves them on a discrete-event clock.
The loop only calls the operations below, so it makes the same decisions over either; what differs is how time passes:

- the engine's clock is ``time.perf_counter``: compute takes the time it takes (``account`` is a no-op) and the
  I/O threads settle transfers on their own (``poll`` is a no-op);
- the simulator's clock moves only when told: ``account`` charges a profiled duration, ``poll`` settles the
  transfers that have ended by ``now()``, and waiting advances the clock to the completion waited for.

Both work under the cache's lock (``cache.lock``, re-entrant): the loop's decisions and the queue's changes are
atomic with respect to the I/O threads.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from specprefetch.runtime.core.cache import Key


@runtime_checkable
class TransferLike(Protocol):
    """What the loop reads and marks on a transfer: its expert, its state, whether it turned out unneeded."""

    key: Key
    state: str        # pending, running, done, failed, cancelled
    unneeded: bool    # a prefetch its target layer did not need: the first eviction candidate once it arrives

    @property
    def finished(self) -> bool: ...


@runtime_checkable
class IOBackend(Protocol):
    """Expert transfers and the clock of one run (see the module docstring)."""

    charge_delays: bool  # False during prefill steps: their loads take no emulated device delay (not timed)
    active: dict[Key, Any]  # the queued and running transfers, by expert
    log: list[Any]          # every transfer of the run, in submission order (step, state, charged, t_start, t_end)

    def now(self) -> float:
        """The compute thread's clock, in seconds."""
        ...

    def account(self, seconds: float) -> None:
        """The compute thread spent ``seconds`` (compute, prediction, bookkeeping)."""
        ...

    def poll(self) -> None:
        """Settle the transfers that have ended by ``now()`` (their experts become resident)."""
        ...

    def submit(self, key: Key, kind: str, step: int) -> TransferLike:
        """Queue a transfer of ``key`` into the slot the caller reserved (``kind``: "demand" or "prefetch")."""
        ...

    def inflight(self, key: Key) -> TransferLike | None:
        """``key``'s queued or running transfer, if any."""
        ...

    def promote(self, key: Key) -> None:
        """A queued or running transfer of ``key`` becomes a demand load."""
        ...

    def cancel_pending(self, layer: int, keep: set[int]) -> list[TransferLike]:
        """Cancel the queued (not started) prefetches of ``layer`` whose expert is not in ``keep``."""
        ...

    def steal(self, key: Key) -> TransferLike | None:
        """Claim ``key``'s queued transfer for the compute thread (None: it is not queued)."""
        ...

    def execute(self, tr: TransferLike) -> None:
        """Perform a claimed transfer on the compute thread (it blocks until the expert is there)."""
        ...

    def wait(self, tr: TransferLike) -> None:
        """Block until ``tr`` has finished (done, failed or cancelled)."""
        ...

    def wait_any(self, timeout: float = 5.0) -> bool:
        """Make progress: a running transfer finishes, or, with none running, the best queued one is performed on
        the compute thread. False when nothing is queued or running (waiting cannot free a slot)."""
        ...

    def drain(self) -> None:
        """Wait until no transfer is queued or running."""
        ...
