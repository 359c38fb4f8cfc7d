"""The per-layer acquire / predict / issue / account logic, one implementation for the runtime and the simulator.

Both drive the same :class:`~specprefetch.runtime.cache.ExpertCache` through an I/O backend with this interface:
:class:`~specprefetch.runtime.transfer.TransferEngine` (I/O threads on the wall clock) and the simulator's
``_SimIO`` (a discrete-event clock):

- ``cancel_pending(layer, keep) -> list[transfer]``: cancel queued prefetches of ``layer`` not in ``keep``;
- ``promote(key)``: a queued or running transfer of ``key`` becomes a demand load;
- ``inflight(key) -> transfer | None``;
- ``submit(key, kind, step, t) -> transfer`` (``kind`` "demand" or "prefetch"; ``t`` the backend's clock, which
  the threaded engine reads itself).

What differs between the two is only how time passes (real compute and waits, or the profiled durations): the
decisions (what is cancelled, promoted, pinned, loaded on demand, selected, prefetched and counted) are these
functions', so the simulator makes the runtime's decisions by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specprefetch.runtime.cache import ExpertCache, Key
from specprefetch.runtime.priority import select_prefetch
from specprefetch.runtime.timeline import LayerEvent


def begin_layer(cache: ExpertCache, io: Any, issued: dict[tuple[int, int], list[Any]], step: int, layer: int,
                t_exec: float, rows: Sequence[Sequence[int]], required: list[int]) -> LayerEvent:
    """``t_exec`` of MoE layer ``layer``: its demand is known. Queued prefetches it does not need are cancelled,
    needed ones promoted; the cache's content is recorded (hits, in flight, misses, ReadyRecall pairs); the
    prefetches issued for this layer are counted (used, wasted: demoted to first eviction candidates, cancelled)."""
    req = set(required)
    with cache.lock:
        cancelled = io.cancel_pending(layer, req)
        for e in required:
            io.promote((layer, e))
        resident = {e for e in required if cache.is_resident((layer, e))}
        inflight = {e for e in required if e not in resident and io.inflight((layer, e)) is not None}
        ev = LayerEvent(step=step, layer=layer, n_tokens=len(rows), t_exec=t_exec, required=required,
                        hits=len(resident), inflight=len(inflight), misses=len(req) - len(resident) - len(inflight),
                        ready_pairs=sum(len(set(r) & resident) for r in rows), t_ready=t_exec, t_compute=t_exec)
        canc = {id(t) for t in cancelled}
        for tr in issued.pop((step, layer), []):
            if tr.state == "cancelled" or id(tr) in canc:
                ev.prefetch_cancelled += 1
            elif tr.key[1] in req:
                ev.prefetch_used += 1
            else:  # transferred (or transferring) for nothing: first to go
                ev.prefetch_wasted += 1
                tr.unneeded = True
                if tr.state == "done":
                    cache.demote(tr.key)
    return ev


def acquire(cache: ExpertCache, io: Any, keys: list[Key], j: int, protect: set[Key], step: int, t: float) -> int:
    """Pin ``keys[j:]`` in order while the cache has room, queueing demand loads; returns the new ``j``."""
    with cache.lock:
        while j < len(keys):
            key = keys[j]
            if not (cache.is_resident(key) or cache.is_inflight(key)):
                if cache.reserve(key, protect, last_resort=True) is None:
                    break
                io.submit(key, "demand", step, t)
            cache.pin(key)
            j += 1
    return j


def issue_prefetches(cache: ExpertCache, io: Any, issued: dict[tuple[int, int], list[Any]], ev: LayerEvent,
                     step: int, layer: int, scores: Any, m_max: int, empty_when_zero: bool, issues: bool,
                     protect: set[Key], t: float, topm_absent: Sequence[int] = ()) -> None:
    """``t_pred`` of layer ``layer``: select ``P^{l+1}`` (Top-M_max of the priorities over experts of layer
    ``layer + 1`` neither resident nor in flight) and, if the policy ``issues``, queue them as prefetches in
    priority order until a slot cannot be freed without evicting what this layer needs. ``topm_absent``: record
    |Top_M(s) minus available| for these M (Figure 1(b))."""
    with cache.lock:
        exclude = cache.unavailable_mask_of_layer(layer + 1)
        cands = select_prefetch(scores, exclude, m_max, empty_when_zero)
        ev.candidates = cands
        for m in topm_absent:
            top = select_prefetch(scores, set(), m, empty_when_zero)
            ev.topm_absent[m] = sum(1 for e in top if e not in exclude)
        if not issues:  # PRED0: the whole control path, no transfer
            return
        for e in cands:
            key = (layer + 1, e)
            if cache.reserve(key, protect, last_resort=False) is None:
                break
            issued[(step, layer + 1)].append(io.submit(key, "prefetch", step, t))
            ev.issued.append(e)
