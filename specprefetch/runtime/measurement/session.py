"""One model, one expert store, many measured runs: the harness behind window profiling and the benchmarks.

A run = a fresh :class:`OffloadedRuntime` (empty cache, or every expert resident; storage prepared, i.e. the
page cache evicted for ``nvme_cold``) decoding every prompt greedily; its result carries the decoding
throughput, the runtime counters, the generated tokens and (optionally) the timeline.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specprefetch.contracts import POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.budget import EwmaBudget, run_budget
from specprefetch.runtime.core.cache import SlotPool
from specprefetch.runtime.core.engine import OffloadedRuntime, RuntimeOptions, install_offloaded, resident_pool
from specprefetch.runtime.core.paper_scale import install_store_experts, match_store
from specprefetch.runtime.core.priority import PriorityProvider, builtin_provider
from specprefetch.runtime.core.storage import ExpertReader, StorageProfile, make_profile, physical_read_ms
from specprefetch.runtime.core.store import ExpertStore, find_moe_blocks
from specprefetch.runtime.core.timeline import LayerEvent, RunStats
from specprefetch.runtime.measurement.decode import (
    Generation,
    Prefilled,
    Prompt,
    collate,
    greedy_generate,
    pad_id_of,
    prefill,
)

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    policy: str
    storage: str
    m_max: int
    compute_opt: bool
    capacity: int
    stats: RunStats
    generations: list[Generation]
    events: list[LayerEvent] = field(default_factory=list)
    transfers: list[Any] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def n_tokens(self) -> int:
        return sum(g.decode_tokens for g in self.generations)

    @property
    def decode_s(self) -> float:
        return sum(g.decode_s for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def tokens(self) -> list[list[int]]:
        """The new tokens of every sequence decoded (a batch's sequences in order)."""
        return [row for g in self.generations for row in g.sequences]


class Harness:
    """Runs the offloaded runtime on a model under the settings of the ``device`` section."""

    def __init__(self, model: nn.Module, spec: Any, store: ExpertStore, settings: dict[str, Any],
                 prompts: list[Prompt], providers: dict[str, Callable[[], PriorityProvider]],
                 device: str = "cpu", capacity: int | None = None, tokenizer: Any = None,
                 batch_pool: list[Prompt] | None = None) -> None:
        self.model = model
        self.spec = spec
        self.store = store
        self.settings = settings
        self.device = torch.device(device)
        self.providers = providers
        self.tokenizer = tokenizer
        self.blocks = find_moe_blocks(model, spec)
        store.check_model(self.blocks)
        match_store(self.blocks, store)  # a paper-scale store: shared experts widened the same way (resident)
        self.originals = install_offloaded(self.blocks)  # fused experts leave the model (never reach the GPU)
        if self.device.type == "cuda":
            model.to(self.device)
        self.prompts = [p.to(self.device) for p in prompts]
        # the prompts a batch is made of (the first B; default: the benchmark's own)
        self.batch_pool = [p.to(self.device) for p in batch_pool] if batch_pool is not None else self.prompts
        self._batches: dict[int, list[Prompt]] = {}
        from specprefetch.runtime.core.settings import cache_capacity

        self.capacity = capacity or cache_capacity(settings, store.total_experts, int(spec.top_k))
        self._readers: dict[str, ExpertReader] = {}
        self._physical_ms: float | None = None
        self._resident: SlotPool | None = None  # every expert, read once for all the all-resident runs
        # the kernel may still be writing back dirty pages (a store just built: GBs): that writeback would share the
        # disk with the measured cold reads, so it is flushed before any run
        os.sync()

    def profile(self, storage: str) -> StorageProfile:
        return make_profile(storage, self.settings, self.store.layout.payload_bytes, self.physical_ms)

    def physical_ms(self) -> float:
        """The isolated cold read of one record on this host that the ``delay`` emulation adds to: the window
        profile's when the benchmark gave it (:meth:`use_physical_ms`), else measured once, here."""
        if self._physical_ms is None:
            self._physical_ms = physical_read_ms(self.store, self.settings)
            log.info("physical cold read of one expert: %.3f ms (median, the delay emulation's base)",
                     self._physical_ms)
        return self._physical_ms

    def use_physical_ms(self, ms: float) -> None:
        """Derive the ``delay`` emulation from this physical read time (ms); readers made before keep theirs."""
        self._physical_ms = float(ms)

    def reader(self, storage: str) -> ExpertReader:
        if storage not in self._readers:
            self._readers[storage] = ExpertReader(self.store, self.profile(storage),
                                                  pin_memory=self.device.type == "cuda")
        return self._readers[storage]

    def provider(self, policy: str, lookahead: int = 1) -> PriorityProvider | None:
        """The priority provider of a run of ``policy`` that prefetches ``lookahead`` layers ahead."""
        from specprefetch.predictors.base import ahead_name

        pol = POLICY[policy]
        if not pol.predicts:
            return None
        if pol.provider is None:  # Naive Prefetch: the previous token's experts
            return builtin_provider(policy, len(self.blocks), self.store.n_experts, lookahead)
        key = ahead_name(str(pol.provider), lookahead)
        if key not in self.providers:
            raise SpecPrefetchError(f"policy {policy!r} needs a {key} predictor, none was given")
        return self.providers[key]()

    def batch_prompts(self, batch: int) -> list[Prompt]:
        """What a run of ``batch`` sequences decodes: the benchmark's prompts for 1, else the first ``batch`` prompts of
        the pool as one left-padded batch (:func:`~specprefetch.runtime.measurement.decode.collate`)."""
        if batch == 1:
            return self.prompts
        if batch not in self._batches:
            if len(self.batch_pool) < batch:
                raise SpecPrefetchError(f"a batch of {batch} needs {batch} prompts; the device workload gave "
                                        f"{len(self.batch_pool)}")
            pad = pad_id_of(self.model, self.tokenizer)
            if pad is None:
                raise SpecPrefetchError("a batch needs a pad token id: the model and tokenizer name none")
            self._batches[batch] = [collate(self.batch_pool[:batch], pad)]
        return self._batches[batch]

    def plain_tokens(self, prompts: list[Prompt] | None = None) -> list[list[int]]:
        """The tokens of :meth:`plain_generations` as a run's :meth:`RunResult.tokens` lists them."""
        return [row for g in self.plain_generations(prompts=prompts) for row in g.sequences]

    def plain_generations(self, max_new_tokens: int | None = None,
                          prompts: list[Prompt] | None = None) -> list[Generation]:
        """The plain model's greedy ``generate()``: every MoE block computes its experts from the store's records,
        all resident (:class:`~specprefetch.runtime.core.paper_scale.ResidentExperts`), with no runtime: the tokens
        every offloaded run must reproduce."""
        with self._experts_restored():
            install_store_experts(self.blocks, self.store, self.device)
            n_new = int(max_new_tokens or self.settings["max_new_tokens"])
            return [greedy_generate(self.model, p, n_new, fixed_length=True, tokenizer=self.tokenizer)
                    for p in prompts or self.prompts]

    @contextlib.contextmanager
    def _experts_restored(self) -> Iterator[None]:
        """Whatever experts modules the block swaps in, the blocks get their current ones back on exit."""
        current = [b.block.experts for b in self.blocks]
        try:
            yield
        finally:
            for b, mod in zip(self.blocks, current, strict=True):
                b.block.experts = mod

    def trained_reference(self) -> list[tuple[list[int], list[torch.Tensor]]] | None:
        """The trained model's own greedy decode of each prompt -- its own routed experts in their trained dtype, not
        the store's (widened, 4-bit) records -- with the experts every MoE layer executed per token ([tokens, K] per
        layer, prefill then decode, as the runs' events record them): what each run's tokens and routing are compared
        with (bench: ``tokens_match_trained``, ``routing_diff_trained``). None on CUDA, where the trained experts
        never reach the GPU."""
        if self.device.type != "cpu":
            return None
        from specprefetch.models.capture import RouterCapture

        with self._experts_restored():
            for b, mod in zip(self.blocks, self.originals, strict=True):
                b.block.experts = mod
            out = []
            for p in self.prompts:
                with RouterCapture(self.model, self.spec) as cap:
                    g = greedy_generate(self.model, p, int(self.settings["max_new_tokens"]), fixed_length=True,
                                        tokenizer=self.tokenizer)
                out.append((g.new_ids, [t.cpu() for t in cap.executed_topk()]))
            return out

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._resident = None

    def runtime(self, policy: str, storage: str, m_max: int = 0, compute_opt: bool = True, record: bool = False,
                preload: bool = False, capacity: int | None = None, topm_absent: tuple[int, ...] = (),
                layer_m_max: tuple[int, ...] = (), lookahead: int = 1,
                ewma: EwmaBudget | None = None, batch: int = 1) -> OffloadedRuntime:
        """A fresh runtime for one run of ``policy`` on ``storage`` (not installed), prefetching ``lookahead`` layers
        ahead; its budget is :func:`~specprefetch.runtime.core.budget.run_budget`'s (none for a policy without
        one), or, with ``ewma``, the online rule's step by step."""
        budget = run_budget(policy, m_max, layer_m_max)
        if (preload or POLICY[policy].preload) and self._resident is None:
            self._resident = resident_pool(self.store, self.device)
        opts = RuntimeOptions(policy=policy, m_max=budget.m_max, layer_m_max=budget.layers,
                              capacity=capacity or self.capacity, compute_opt=compute_opt,
                              io_workers=int(self.settings["io_workers"]), io_retries=int(self.settings["io_retries"]),
                              record_routing=record, preload=preload, topm_absent=topm_absent,
                              lookahead=int(lookahead), ewma=ewma, batch=int(batch))
        return OffloadedRuntime(self.model, self.store, self.reader(storage), opts, self.provider(policy, lookahead),
                                spec=self.spec, device=self.device, resident=self._resident)

    def run(self, policy: str, storage: str, m_max: int = 0, compute_opt: bool = True, record: bool = False,
            preload: bool = False, capacity: int | None = None, topm_absent: tuple[int, ...] = (),
            max_new_tokens: int | None = None, prompts: list[Prompt] | None = None,
            on_runtime: Callable[[OffloadedRuntime], Any] | None = None,
            layer_m_max: tuple[int, ...] = (), lookahead: int = 1, ewma: EwmaBudget | None = None) -> RunResult:
        """One measured run of ``policy`` (see the module docstring); ``layer_m_max``: per-layer budgets;
        ``lookahead``: how many layers ahead it prefetches; ``ewma``: the online budget rule."""
        prompts = list(prompts or self.prompts)
        rt = self.runtime(policy, storage, m_max, compute_opt, record, preload, capacity, topm_absent, layer_m_max,
                          lookahead, ewma, _batch_of(prompts))
        gens: list[Generation] = []
        n_new = int(max_new_tokens or self.settings["max_new_tokens"])
        gc.collect()
        gc.disable()
        try:
            rt.install()
            if on_runtime is not None:
                on_runtime(rt)
            rt.reset_run()
            t0 = time.perf_counter()
            for p in prompts:
                rt.new_sequence()
                gens.append(greedy_generate(self.model, p, n_new, fixed_length=True, tokenizer=self.tokenizer))
            wall = time.perf_counter() - t0
        finally:
            gc.enable()
            rt.uninstall()
            rt.close()
        return _logged(_result(rt, storage, gens, wall))

    def run_lockstep(self, runs: list[dict[str, Any]], seed: str, max_new_tokens: int | None = None,
                     prompts: list[Prompt] | None = None) -> list[RunResult]:
        """Several runs decoded in lockstep, one token at a time: in every round each run decodes its next token, the
        runs in a fresh random order (seeded by ``seed``). ``runs``: keyword arguments of :meth:`runtime`.

        A paired comparison of two runs then sees the host over the same second, not over two separate runs tens of
        seconds apart (a shared disk's latency drifts on that scale). Only one run computes at a time: each has its
        own thread, runtime, cache and KV cache, and hands the model to the next run after its token, once its own
        transfers are finished (the wait counts in its time, so leftovers are never hidden by the hand-over). Each
        run's clock stops while the others decode: its timestamps (tokens, layer events, transfers) are mapped onto
        its own time, as if it had run alone (:func:`own_time`).

        The first prompt's prefill is computed once, by the first run without every expert resident, and every run
        decodes on from a copy of its state (KV cache, first token, expert cache, the routing its predictor saw:
        :meth:`OffloadedRuntime.adopt`), which is what each run's own prefill would have left (a prefill loads on
        demand only, whatever the policy). Runs then start decoding from one state, and the untimed prefill is
        paid once per block instead of once per run. Later prompts are prefilled by each run."""
        n_new = int(max_new_tokens or self.settings["max_new_tokens"])
        prompts = list(prompts or self.prompts)
        back = threading.Event()
        lanes = [_Lane(i, self.runtime(**kw, batch=_batch_of(prompts)), back) for i, kw in enumerate(runs)]
        rng = random.Random(f"specprefetch/lockstep/{seed}")
        start: Prefilled | None = None

        def decode(lane: _Lane) -> None:
            try:
                lane.wait_turn()
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    if i or start is None:
                        lane.rt.new_sequence()
                    lane.gens.append(greedy_generate(self.model, p, n_new, fixed_length=True, tokenizer=self.tokenizer,
                                                     between_tokens=lane.hand_over, start=None if i else start))
                lane.wall = time.perf_counter() - t0
            except BaseException as exc:  # handed to the scheduler, which re-raises it
                lane.error = exc
            finally:
                lane.finished = True
                back.set()

        gc.collect()
        gc.disable()
        threads = []
        try:
            for lane in lanes:
                lane.rt.install()
                lane.rt.reset_run()
            start = self._shared_prefill([lane.rt for lane in lanes], prompts[0]) if prompts else None
            threads = [threading.Thread(target=decode, args=(lane,), name=f"lockstep-{lane.index}", daemon=True)
                       for lane in lanes]
            for t in threads:
                t.start()
            active = list(lanes)
            while active:
                for lane in rng.sample(active, len(active)):
                    back.clear()
                    lane.rt.activate()
                    lane.turn.set()
                    back.wait()
                    if lane.error is not None:
                        raise lane.error
                active = [lane for lane in active if not lane.finished]
        finally:
            for lane in lanes:  # wake any run still waiting for a turn: it stops
                lane.stop = True
                lane.turn.set()
            for t in threads:
                t.join(timeout=60)
            gc.enable()
            for lane in lanes:
                lane.rt.uninstall()
                lane.rt.close()
        out = []
        for lane, kw in zip(lanes, runs):
            res = _result(lane.rt, kw["storage"], lane.gens, lane.wall - sum(b - a for a, b in lane.pauses))
            out.append(_logged(own_time(res, lane.pauses)))
        return out

    def _shared_prefill(self, runtimes: list[OffloadedRuntime], prompt: Prompt) -> Prefilled | None:
        """``prompt``'s prefill by the first runtime without every expert resident, adopted by the others; None
        (each run prefills) where their caches differ in capacity."""
        if len({rt.capacity for rt in runtimes if not rt.preload}) > 1:
            return None
        src = next((rt for rt in runtimes if not rt.preload), runtimes[0])
        src.activate()
        src.new_sequence()
        start = prefill(self.model, prompt, self.tokenizer)
        for rt in runtimes:
            if rt is not src:
                rt.adopt(src)
        return start


def _batch_of(prompts: list[Prompt]) -> int:
    """The batch size every prompt of a run has (one runtime decodes one batch size)."""
    sizes = {p.batch for p in prompts}
    if len(sizes) > 1:
        raise SpecPrefetchError(f"one run decodes prompts of one batch size, not {sorted(sizes)}")
    return sizes.pop() if sizes else 1


class _Stopped(Exception):
    """A lockstep run told to stop (another run failed)."""


@dataclass
class _Lane:
    """One run of :meth:`Harness.run_lockstep`: its runtime, its tokens and the intervals it was paused."""

    index: int
    rt: OffloadedRuntime
    back: threading.Event  # set when this run yields the model (or ends): the scheduler's cue
    gens: list[Generation] = field(default_factory=list)
    pauses: list[tuple[float, float]] = field(default_factory=list)
    turn: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    stop: bool = False
    error: BaseException | None = None
    wall: float = 0.0

    def wait_turn(self) -> None:
        self.turn.wait()
        self.turn.clear()
        if self.stop:
            raise _Stopped

    def hand_over(self) -> None:
        """After a token: finish this run's transfers, let the scheduler give the model to the next run, resume."""
        self.rt.engine.drain()
        t0 = time.perf_counter()
        self.back.set()
        self.wait_turn()
        self.pauses.append((t0, time.perf_counter()))


def own_time(res: RunResult, pauses: list[tuple[float, float]]) -> RunResult:
    """``res`` with every timestamp on the run's own clock: the time of the ``pauses`` (sorted, disjoint intervals
    during which other runs decoded) before it removed; a time inside a pause is its start."""
    if not pauses:
        return res
    starts = [a for a, _ in pauses]
    cum = list(itertools.accumulate(b - a for a, b in pauses))

    def f(t: float) -> float:
        if not t:
            return t  # unset
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return t
        a, b = pauses[i]
        before = cum[i - 1] if i else 0.0
        return a - before if t < b else t - cum[i]

    for g in res.generations:
        g.times = [f(t) for t in g.times]
    for ev in res.events:
        ev.t_exec, ev.t_compute, ev.t_ready, ev.t_done = f(ev.t_exec), f(ev.t_compute), f(ev.t_ready), f(ev.t_done)
        if ev.t_pred is not None:
            ev.t_pred = f(ev.t_pred)
    for tr in res.transfers:
        tr.t_submit, tr.t_start, tr.t_end = f(tr.t_submit), f(tr.t_start), f(tr.t_end)
        for name in ("t_woken", "t_offered"):  # set on the engine's transfers only
            if getattr(tr, name, 0.0):
                setattr(tr, name, f(getattr(tr, name)))
    return res


def _result(rt: OffloadedRuntime, storage: str, gens: list[Generation], wall: float) -> RunResult:
    o = rt.opt
    return RunResult(o.policy, storage, o.m_max, o.compute_opt, rt.capacity, rt.stats(), gens, rt.events,
                     list(rt.engine.log), wall)


def _logged(res: RunResult) -> RunResult:
    """Log a run's result (on its own clock: a lockstep run's after :func:`own_time`)."""
    log.info("%-12s %-9s M=%-2d opt=%d: %.2f tok/s, ReadyRecall %.3f, hits %d, misses %d, prefetched %d, "
             "stall %.1f ms", res.policy, res.storage, res.m_max, res.compute_opt, res.tokens_per_s,
             res.stats.ready_recall, res.stats.hits, res.stats.misses, res.stats.prefetched, res.stats.stall_ms)
    return res
