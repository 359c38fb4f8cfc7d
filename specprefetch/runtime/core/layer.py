"""The per-layer loop of the offloaded runtime, written once for the runtime and the simulator.

One MoE layer (:meth:`LayerLoop.run`):

1. ``t_exec``: the layer's demand T^l is known (:func:`begin_layer`). Queued prefetches it does not need are
   cancelled, needed ones promoted to demand loads; the cache's content is recorded (hits, in flight, misses,
   ReadyRecall pairs) and the prefetches issued for this layer are counted.
2. Required experts are pinned in ascending id while the cache has room, absent ones queued as demand loads
   (:func:`acquire`).
3. In a decoding step (one new token per sequence of the ``batch``) a predicting policy's provider gives the
   priorities ``s^{l+d}`` (``t_pred``; the look-ahead ``d`` is the provider's, 1 in the paper; with a batch they are
   the paper's batch priorities, summed over the batch's tokens); the top ``M_max`` experts of layer ``l+d`` neither
   resident nor in flight are queued as prefetches in priority order (:func:`issue_prefetches`; PRED0 selects and
   issues nothing).
4. Compute, in ascending expert id: each expert is waited for until resident (the stall; a queued load is performed
   by the compute thread itself, a failed one reloaded on demand), computed and released -- or, with ``compute_opt``
   in a decoding step of one sequence, all K experts are waited for and then computed at once (the batched fast
   path; a batch of several sequences computes expert by expert, as transformers' eager loop does).
5. The layer's experts become the most recently used; the provider observes the layer's routing (``t_done``).

A provider of stage ``pre_attention`` (beyond the paper) predicts at another point: not in step 3, but before the
next layer's attention (:meth:`LayerLoop.pre_attention`, called by whoever runs the layers once layer ``l`` is done),
from that layer's pre-attention input. Its prediction, selection and prefetches are recorded in layer ``l``'s event
like a router-stage one's (``early`` marks them), so the window it gives layer ``l+1`` is that layer's attention.

The loop runs over an :class:`~specprefetch.runtime.core.iobackend.IOBackend`:
:class:`~specprefetch.runtime.core.transfer.TransferEngine` (I/O threads, wall clock) or the simulator's ``_SimIO``
(discrete-event clock), and a :class:`LayerWork`: what "compute" is (the runtime's matmuls, or the simulator
charging profiled durations to its clock). Every decision -- what is cancelled, promoted, pinned, loaded on
demand, selected, prefetched, waited for and counted -- is this module's, so the simulator makes the runtime's
decisions by construction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specprefetch.runtime.core.budget import EwmaBudget
from specprefetch.runtime.core.cache import CacheError, ExpertCache, Key
from specprefetch.runtime.core.iobackend import IOBackend, TransferLike
from specprefetch.runtime.core.priority import PriorityProvider, select_prefetch
from specprefetch.runtime.core.timeline import LayerEvent, window_ms

Issued = dict[tuple[int, int], list[Any]]  # (step, target layer) -> the prefetches issued for it


def begin_layer(cache: ExpertCache, io: IOBackend, issued: Issued, step: int, layer: int, t_exec: float,
                rows: Sequence[Sequence[int]], required: list[int]) -> LayerEvent:
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


def acquire(cache: ExpertCache, io: IOBackend, keys: list[Key], j: int, protect: set[Key], step: int) -> int:
    """Pin ``keys[j:]`` in order while the cache has room, queueing demand loads; returns the new ``j``."""
    with cache.lock:
        while j < len(keys):
            key = keys[j]
            if not (cache.is_resident(key) or cache.is_inflight(key)):
                if cache.reserve(key, protect, last_resort=True) is None:
                    break
                io.submit(key, "demand", step)
            cache.pin(key)
            j += 1
    return j


def issue_prefetches(cache: ExpertCache, io: IOBackend, issued: Issued, ev: LayerEvent, step: int, target: int,
                     scores: Any, m_max: int, empty_when_zero: bool, issues: bool, protect: set[Key],
                     topm_absent: Sequence[int] = ()) -> None:
    """``t_pred``: select ``P^{target}`` (Top-M_max of the priorities over experts of layer ``target`` -- ``l+1``
    in the paper, ``l+d`` with a look-ahead -- neither resident nor in flight) and, if the policy ``issues``, queue
    them as prefetches in priority order until a slot cannot be freed without evicting what this layer needs.
    ``topm_absent``: record |Top_M(s) minus available| for these M (Figure 1(b))."""
    with cache.lock:
        exclude = cache.unavailable_mask_of_layer(target)
        cands = select_prefetch(scores, exclude, m_max, empty_when_zero)
        ev.candidates = cands
        for m in topm_absent:
            top = select_prefetch(scores, set(), m, empty_when_zero)
            ev.topm_absent[m] = sum(1 for e in top if e not in exclude)
        if not issues:  # PRED0: the whole control path, no transfer
            return
        for e in cands:
            key = (target, e)
            if cache.reserve(key, protect, last_resort=False) is None:
                break
            issued[(step, target)].append(io.submit(key, "prefetch", step))
            ev.issued.append(e)


class LayerWork(Protocol):
    """What one MoE layer computes and how long it takes: the part of the loop the runtime and the simulator do
    differently (real computation on the wall clock, or profiled durations charged to the virtual clock)."""

    def scores(self, provider: PriorityProvider, layer: int) -> Any:
        """The provider's priorities for layer ``layer + provider.lookahead`` (None: none this step); the prediction's
        time passes."""
        ...

    def prepared(self, ev: LayerEvent, predicted: bool, batched: bool) -> None:
        """The control path before the compute phase is over (bookkeeping, or prediction and issue); the experts
        will be computed at once (``batched``) or one by one."""
        ...

    def expert(self, key: Key, slot: int) -> None:
        """Compute one resident expert (the loop path); its slot is released after this returns."""
        ...

    def batched(self, keys: list[Key], slots: list[int], release: Callable[[], None]) -> None:
        """Compute all the layer's experts at once (the ``compute_opt`` path); call ``release`` as soon as their
        slots are no longer read (the loop calls it afterwards if this did not)."""
        ...

    def finish(self, provider: PriorityProvider | None) -> None:
        """The layer is done: the provider observes its routing."""
        ...

    def issued(self, ev: LayerEvent) -> None:
        """A pre-attention prediction recorded in ``ev`` is selected and issued (its control path is over)."""
        ...


def _load_error(key: Key) -> Exception:
    return CacheError(f"expert {key[1]} of MoE layer {key[0]} could not be loaded (every attempt failed)")


def _no_budget(layer: int) -> int:
    return 0


@dataclass(eq=False)
class LayerLoop:
    """The per-layer loop of one run (see the module docstring): the cache, the I/O backend, the policy's provider
    (None: no prediction), its budget and the per-run choices; ``events`` collects one :class:`LayerEvent` per layer
    call."""

    cache: ExpertCache
    io: IOBackend
    provider: PriorityProvider | None
    issues: bool                        # the policy prefetches what it selects (PRED0 does not)
    n_layers: int
    n_experts: int
    budget_of: Callable[[int], int] = _no_budget  # M_max of the prefetches into a layer (asked when predicting)
    compute_opt: bool = True            # the batched fast path for decoding steps
    sync: bool = False                  # wait for every transfer at the end of each layer (and prediction)
    retries: int = 0                    # reloads of an expert whose transfer failed, beyond the backend's own
    record: bool = False                # keep each event's priorities (simulator input)
    topm_absent: tuple[int, ...] = ()   # record |Top_M(s) minus available| at t_pred for these M (Figure 1b)
    load_error: Callable[[Key], Exception] = _load_error  # the error when an expert cannot be loaded at all
    online: EwmaBudget | None = None    # an online budget rule: it overrides ``budget_of`` when given
    batch: int = 1                      # sequences decoded together: a decoding step has one token of each
    issued: Issued = field(default_factory=lambda: defaultdict(list))
    events: list[LayerEvent] = field(default_factory=list)

    def run(self, step: int, layer: int, rows: Sequence[Sequence[int]], work: LayerWork,
            t_exec: float | None = None, topk: Any = None) -> LayerEvent:
        """One call of MoE layer ``layer`` in step ``step``: ``rows`` are its tokens' top-k expert ids, ``t_exec``
        when the demand became known (default: now), ``topk`` what the event records as the routing
        (``record_routing``)."""
        io, cache = self.io, self.cache
        io.poll()
        decoding = len(rows) == self.batch  # one new token per sequence (a prefill has several per sequence)
        io.charge_delays = decoding  # prefill loads take no emulated delay (prefill is not timed)
        if t_exec is None:
            t_exec = io.now()
        required = sorted({e for r in rows for e in r if 0 <= e < self.n_experts})
        keys = [(layer, e) for e in required]
        ev = begin_layer(cache, io, self.issued, step, layer, t_exec, rows, required)
        ev.decode = decoding
        if topk is not None:
            ev.topk = topk
        if decoding and self.online is not None:
            self._observe(ev)
        self.events.append(ev)
        protect = set(keys)
        j = acquire(cache, io, keys, 0, protect, step)
        predicted = (decoding and self.provider is not None and not self.early
                     and layer + self.provider.lookahead < self.n_layers)
        if predicted:
            self.predict(ev, step, layer, work, protect)
        batched = self.compute_opt and decoding and len(rows) == 1 and len(keys) == len(rows[0])
        work.prepared(ev, predicted, batched)
        if batched:
            self._compute_batched(keys, j, protect, ev, work, step)
        else:
            self._compute_each(keys, j, protect, ev, work, step)
        if self.sync:
            io.drain()
        with cache.lock:  # LRU: the layer used its experts (in ascending id, whatever order they arrived in)
            for key in keys:
                cache.touch(key)
        work.finish(self.provider)
        ev.t_done = io.now()
        io.poll()
        return ev

    @property
    def early(self) -> bool:
        """The provider predicts before the next layer's attention, not at this layer's router."""
        return self.provider is not None and getattr(self.provider, "stage", "router") == "pre_attention"

    def pre_attention(self, step: int, layer: int, work: LayerWork) -> None:
        """Before layer ``layer``'s attention in a decoding step: a pre-attention provider's priorities for ``layer``
        from its pre-attention input (``work.scores``), selected at that layer's budget and prefetched, all recorded
        in the event of layer ``layer - 1`` (done by now; nothing is pinned), the prediction it stands for."""
        prev = self.events[-1] if self.events else None
        if (not self.early or prev is None or prev.step != step or prev.layer != layer - 1 or not prev.decode
                or layer >= self.n_layers):
            return
        prev.early = True
        self.predict(prev, step, layer - 1, work, set())
        work.issued(prev)
        if self.sync:  # deterministic runs: these transfers end before the layer goes on, as a layer's own do
            self.io.drain()

    def predict(self, ev: LayerEvent, step: int, layer: int, work: LayerWork, protect: set[Key]) -> None:
        """``t_pred``: the provider's priorities for ``layer + d`` (``d``: the provider's look-ahead), the selection at
        that layer's budget and (if the policy issues) the prefetches, in priority order."""
        provider = self.provider
        if provider is None:
            return
        target = layer + provider.lookahead
        s = work.scores(provider, layer)
        ev.t_pred = self.io.now()
        if s is None:
            return
        if self.record:
            ev.scores = torch.as_tensor(s).clone()
        self.io.poll()
        if self.online is None:
            ev.m_max = self.budget_of(target)
        else:  # the transfers ahead of the new prefetches, but the layer's own demand (its stall is not in the window)
            with self.cache.lock:
                queued = sum(1 for key in self.io.active if key not in protect)
            ev.m_max = self.online.budget(queued, provider.lookahead)
        issue_prefetches(self.cache, self.io, self.issued, ev, step, target, s, ev.m_max,
                         provider.empty_when_zero, self.issues, protect, self.topm_absent)

    def _observe(self, ev: LayerEvent) -> None:
        """Feed the online budget what the run measured by ``ev``'s t_exec: the window the previous layer of the step
        gave this one, and, at a step's first layer, the earlier steps' transfers."""
        prev = self.events[-1] if self.events else None
        if prev is not None and prev.step == ev.step and prev.layer == ev.layer - 1 and prev.t_pred is not None:
            self.online.observe_window(window_ms(prev, ev))
        if ev.layer == 0:
            with self.cache.lock:
                self.online.observe_transfers(self.io.log, ev.step)

    def _wait_for_room(self) -> None:
        if not self.io.wait_any():
            raise CacheError(f"expert cache of {self.cache.capacity} experts cannot hold one more expert "
                             "(every slot pinned)")

    def ensure(self, key: Key, protect: set[Key], step: int) -> int:
        """Block until the pinned ``key`` is resident; returns its slot. A queued transfer is performed by the
        compute thread; one that failed (slot and pin released) is loaded again on demand, ``retries`` times."""
        io, cache = self.io, self.cache
        io.poll()
        failures = 0
        while True:
            tr: TransferLike | None
            with cache.lock:
                if cache.is_resident(key):
                    return cache.slot(key)
                tr = io.inflight(key)
                if tr is None:  # its transfer failed: load it again, on demand
                    failures += 1
                    if failures > self.retries + 1:
                        raise self.load_error(key)
                    if cache.reserve(key, protect, last_resort=True) is not None:
                        cache.pin(key)
                        tr = io.submit(key, "demand", step)
            if tr is None:
                self._wait_for_room()
            elif io.steal(key) is tr:
                io.execute(tr)  # not started by any worker: load it on this thread
            else:
                io.wait(tr)

    def _release(self, key: Key, protect: set[Key]) -> None:
        self.cache.unpin(key)
        protect.discard(key)

    def _compute_each(self, keys: list[Key], j: int, protect: set[Key], ev: LayerEvent, work: LayerWork,
                      step: int) -> None:
        """Expert by expert in ascending id: wait until resident (pinning the rest as room frees up), compute,
        release."""
        io, cache = self.io, self.cache
        stall = 0.0
        ev.t_compute = ev.t_ready = io.now()
        for i, key in enumerate(keys):
            t0 = io.now()
            waited = j <= i or not cache.is_resident(key)
            while j <= i:
                self._wait_for_room()
                j = acquire(cache, io, keys, j, protect, step)
            slot = self.ensure(key, protect, step)
            t1 = io.now()
            if waited:
                ev.t_ready = t1
            stall += t1 - t0
            work.expert(key, slot)
            with cache.lock:
                self._release(key, protect)
                io.poll()
                j = acquire(cache, io, keys, j, protect, step)
        ev.stall_s = stall

    def _compute_batched(self, keys: list[Key], j: int, protect: set[Key], ev: LayerEvent, work: LayerWork,
                         step: int) -> None:
        """One decoding token: wait until all K experts are resident, then compute them at once."""
        io, cache = self.io, self.cache
        t0 = ev.t_compute = ev.t_ready = io.now()
        while j < len(keys):
            self._wait_for_room()
            j = acquire(cache, io, keys, j, protect, step)
        slots = [self.ensure(k, protect, step) for k in keys]
        ev.t_ready = io.now()
        ev.stall_s = ev.t_ready - t0
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                with cache.lock:
                    for k in keys:
                        self._release(k, protect)

        work.batched(keys, slots, release)
        release()
