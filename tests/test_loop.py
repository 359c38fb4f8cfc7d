"""The one per-layer loop (runtime.core.layer.LayerLoop) over the declared I/O backend
(runtime.core.iobackend.IOBackend).

Both backends -- the threaded TransferEngine on the wall clock and the simulator's discrete-event _SimIO -- satisfy
the Protocol and behave alike on the operations the loop uses; the loop makes the same decisions over either; and
the drifts the simulator once had from the runtime are gone by construction (the provider's empty_when_zero, the
runtime's Naive provider, the Policy table's preload flag, every pin released on every path, one replay input).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specprefetch.contracts import POLICIES, POLICY
from specprefetch.runtime.core.cache import ExpertCache, Key, SlotPool
from specprefetch.runtime.core.iobackend import IOBackend, TransferLike
from specprefetch.runtime.core.layer import LayerLoop
from specprefetch.runtime.core.priority import PreviousTokenPriority, PriorityProvider, builtin_provider
from specprefetch.runtime.core.storage import ExpertReader, StorageProfile, make_profile
from specprefetch.runtime.core.store import ExpertStore, build_expert_store
from specprefetch.runtime.core.timeline import LayerEvent, routing_rows
from specprefetch.runtime.core.transfer import TransferEngine
from specprefetch.runtime.simulation.simulator import (
    ComputeProfile,
    ReplayPriority,
    SimSequence,
    SimStep,
    _SimIO,
    replay_provider,
    sequences_from_record,
    simulate,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    from tests.test_runtime import tiny_qwen

    return ExpertStore(build_expert_store(tiny_qwen(), tmp_path_factory.mktemp("store") / "experts", model_name="t"))


def _engine(store: ExpertStore, capacity: int, workers: int = 1) -> Iterator[TransferEngine]:
    from specprefetch.config import section_defaults

    reader = ExpertReader(store, make_profile("ram", section_defaults("device"), store.layout.payload_bytes))
    cache = ExpertCache(capacity)
    eng = TransferEngine(reader, cache, SlotPool(capacity, store.layout, torch.device("cpu")), workers, 0)
    try:
        yield eng
    finally:
        eng.shutdown()
        reader.close()


def _sim(capacity: int) -> _SimIO:
    return _SimIO(ExpertCache(capacity), StorageProfile("ram", "ram"), 1, 0.0, 1e-3)


BACKENDS: dict[str, Callable[[ExpertStore, int], Any]] = {
    "engine": lambda store, cap: _engine(store, cap),
    "sim": lambda store, cap: iter([_sim(cap)]),
}


# ------------------------------------------------------------------------------------------ the Protocol
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backends_satisfy_the_protocol_and_behave_alike(store: ExpertStore, backend: str) -> None:
    """Demand loads stay queued for the compute thread and hold prefetches back; a queued prefetch is cancelled;
    a stolen transfer is performed on the calling thread; waiting makes progress, and says when none is possible."""
    gen = BACKENDS[backend](store, 8)
    io = next(gen)
    try:
        assert isinstance(io, IOBackend)
        cache = io.cache
        t0 = io.now()
        with cache.lock:  # the engine's workers take nothing while the lock is held
            cache.reserve((0, 0))
            d = io.submit((0, 0), "demand", 0)
            cache.reserve((1, 5))
            p = io.submit((1, 5), "prefetch", 0)
            assert isinstance(d, TransferLike) and io.inflight((0, 0)) is d
            assert p.state == "pending"  # a demand load is outstanding: no prefetch starts
            assert io.cancel_pending(1, set()) == [p]
        assert p.state == "cancelled" and p.finished and io.inflight((1, 5)) is None
        assert not cache.is_inflight((1, 5)) and not cache.is_resident((1, 5))
        assert io.steal((0, 0)) is d and io.steal((0, 0)) is None  # claimed once
        io.execute(d)
        assert d.finished and cache.is_resident((0, 0)) and io.inflight((0, 0)) is None
        with cache.lock:
            cache.reserve((1, 6))
            q = io.submit((1, 6), "prefetch", 0)
        io.wait(q)
        io.poll()
        assert q.state == "done" and cache.is_resident((1, 6))
        # a promoted prefetch is a demand load: wait_any performs the best queued transfer itself
        with cache.lock:
            cache.reserve((2, 1))
            io.submit((2, 1), "demand", 0)
            cache.reserve((2, 2))
            io.submit((2, 2), "prefetch", 0)
            io.promote((2, 2))
        while io.wait_any():
            pass
        assert cache.is_resident((2, 1)) and cache.is_resident((2, 2))
        assert io.wait_any() is False  # nothing queued or running: waiting cannot free a slot
        io.drain()
        io.account(0.5)
        assert io.now() >= t0 + (0.5 if backend == "sim" else 0.0)
    finally:
        for _ in gen:
            pass


def test_the_sim_clock_moves_with_what_the_compute_thread_does() -> None:
    """The discrete-event clock: account charges, a performed transfer takes its modelled time, waiting jumps to
    the completion waited for."""
    io = _sim(4)
    io.account(0.25)
    assert io.now() == 0.25
    with io.cache.lock:
        io.cache.reserve((0, 1))
        d = io.submit((0, 1), "demand", 0)
    assert io.steal((0, 1)) is d
    io.execute(d)
    assert io.now() == pytest.approx(0.251) and d.t_start == 0.25
    io.cache.reserve((0, 2))
    p = io.submit((0, 2), "prefetch", 0)  # a sleeping worker starts it at once
    assert p.state == "running"
    io.wait(p)
    assert io.now() == pytest.approx(0.252) and io.cache.is_resident((0, 2))


# ------------------------------------------------------------------------------------------ one loop, two backends
class _Scripted(PriorityProvider):
    """Fixed priorities per (step, layer)."""

    name = "scripted"

    def __init__(self, scores: dict[tuple[int, int], torch.Tensor], empty_when_zero: bool = False) -> None:
        self.table = scores
        self.step = 0
        self.empty_when_zero = empty_when_zero

    def scores(self, layer: int, x: Any) -> torch.Tensor | None:
        return self.table.get((self.step, layer))


class _NoCompute:
    """A LayerWork that computes nothing (and never releases: the loop must)."""

    def __init__(self) -> None:
        self.experts: list[Key] = []

    def scores(self, provider: PriorityProvider, layer: int) -> Any:
        return provider.scores(layer, None)

    def prepared(self, ev: LayerEvent, predicted: bool, batched: bool) -> None:
        pass

    def expert(self, key: Key, slot: int) -> None:
        self.experts.append(key)

    def batched(self, keys: list[Key], slots: list[int], release: Callable[[], None]) -> None:
        self.experts.extend(keys)

    def finish(self, provider: PriorityProvider | None) -> None:
        pass


def _script(n_layers: int, n: int, k: int, steps: int, seed: int = 0) -> tuple[list[list[list[int]]], dict]:
    g = torch.Generator().manual_seed(seed)
    rows = [[sorted(torch.randperm(n, generator=g)[:k].tolist()) for _ in range(n_layers)] for _ in range(steps)]
    scores = {(s, l): torch.rand(n, generator=g) for s in range(steps) for l in range(n_layers - 1)}
    return rows, scores


def _drive(io: IOBackend, cache: ExpertCache, compute_opt: bool, store: ExpertStore) -> list[LayerEvent]:
    rows, table = _script(store.n_layers, store.n_experts, 4, 12)
    provider = _Scripted(table)
    loop = LayerLoop(cache, io, provider, True, store.n_layers, store.n_experts, lambda layer: 3,
                     compute_opt=compute_opt, sync=True)
    work = _NoCompute()
    for step, layers in enumerate(rows):
        provider.step = step
        for l, r in enumerate(layers):
            loop.run(step, l, [r], work)
            assert not cache.pins, "every pin is released, on both compute paths"
    assert work.experts == [(l, e) for layers in rows for l, r in enumerate(layers) for e in r]
    return loop.events


@pytest.mark.parametrize("compute_opt", [True, False])
def test_one_loop_makes_the_same_decisions_over_both_backends(store: ExpertStore, compute_opt: bool) -> None:
    """The same routing and priorities through LayerLoop over the threaded engine and over the discrete-event
    backend (one worker, every transfer settled at the end of each layer): the same hits, misses, selections,
    prefetches and their fate, layer by layer."""
    cap = 4 + 3
    gen = _engine(store, cap)
    eng = next(gen)
    try:
        a = _drive(eng, eng.cache, compute_opt, store)
    finally:
        for _ in gen:
            pass
    sim = _sim(cap)
    b = _drive(sim, sim.cache, compute_opt, store)
    fields = ("step", "layer", "required", "hits", "inflight", "misses", "ready_pairs", "candidates", "issued",
              "prefetch_used", "prefetch_wasted", "prefetch_cancelled")
    assert [[getattr(e, f) for f in fields] for e in a] == [[getattr(e, f) for f in fields] for e in b]
    assert sum(e.prefetch_used for e in a) > 0 and sum(e.misses for e in a) > 0  # not a vacuous script


# ------------------------------------------------------------------------------------------ the drifts, gone
def test_empty_when_zero_is_the_providers() -> None:
    """The loop reads empty_when_zero from the provider it runs: zero priorities end the selection or not."""
    cap, n = 32, 8
    zeros = torch.tensor([0.0, 0.9, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    got = {}
    for flag in (True, False):
        io = _sim(cap)
        loop = LayerLoop(io.cache, io, _Scripted({(0, 0): zeros}, empty_when_zero=flag), True, 2, n, lambda layer: 4)
        ev = loop.run(0, 0, [[0, 1]], _NoCompute())
        got[flag] = ev.candidates
    assert got[True] == [1, 3] and got[False] == [1, 3, 0, 2]
    # the simulator's provider carries the flag of the provider that produced its priorities
    assert replay_provider("naive", 2, n).empty_when_zero is PreviousTokenPriority.empty_when_zero is True
    assert replay_provider("specprefetch", 2, n).empty_when_zero is False
    assert replay_provider("off", 2, n) is None


def test_simulator_runs_the_runtimes_naive_provider() -> None:
    """Naive Prefetch's provider comes from one factory (the harness, lm-eval and the simulator); without recorded
    priorities the simulator's is that object, fed the replayed routing, and it selects the previous token's
    experts of the next layer ranked by routing weight."""
    assert isinstance(builtin_provider("naive", 3, 8), PreviousTokenPriority)
    assert all(builtin_provider(p, 3, 8) is None for p in POLICIES if p != "naive")
    rp = replay_provider("naive", 3, 8)
    assert isinstance(rp, ReplayPriority) and isinstance(rp.live, PreviousTokenPriority)
    steps = [SimStep(topk=[[[0, 1]], [[2, 3]], [[4, 5]]], weights=[[0.5, 0.5], [0.2, 0.8], [0.9, 0.1]]),
             SimStep(topk=[[[6, 7]], [[6, 7]], [[6, 7]]], weights=[[0.5, 0.5]] * 3)]
    zero = [0.0] * 3
    prof = ComputeProfile(zero, zero, zero, [1e-4] * 3, zero, 1e-4)
    res = simulate([SimSequence(steps)], "naive", 2, 2, 8, 2, prof, StorageProfile("ram", "ram"), 1,
                   fixed_transfer_s=0.0)  # room for one layer: the previous token's experts are never resident
    ev = {(e.step, e.layer): e for e in res.events}
    assert ev[(1, 0)].candidates == [3, 2] and ev[(1, 1)].candidates == [4, 5]  # by the previous token's weight
    with pytest.raises(Exception, match="no recorded priorities"):
        simulate([SimSequence(steps)], "specprefetch", 2, 6, 8, 2, prof, StorageProfile("ram", "ram"))


def test_simulator_preloads_by_the_policy_table() -> None:
    """Every expert is resident before the run exactly for the policies the Policy table marks ``preload``."""
    steps = [SimStep(topk=[[[0, 1]], [[2, 3]]], scores=[torch.rand(8), None]) for _ in range(3)]
    zero = [0.0] * 2
    prof = ComputeProfile(zero, zero, zero, [1e-4] * 2, zero, 1e-4)
    for policy in POLICIES:
        res = simulate([SimSequence(steps)], policy, 2, 4, 8, 2, prof, StorageProfile("ram", "ram"),
                       fixed_transfer_s=1e-3)
        assert (res.stats.misses == 0 and res.stats.ready_recall == 1.0) is POLICY[policy].preload, policy


def test_one_replay_input_for_events_and_records(store: ExpertStore, tmp_path: Path) -> None:
    """A runtime's events (routing_rows) and the benchmark's routing record of the same run are the same
    simulator sequences (one function reads both)."""
    from specprefetch.runtime.measurement.bench import recorded_routing

    gen = _engine(store, 7)
    eng = next(gen)
    try:
        rows, table = _script(store.n_layers, store.n_experts, 4, 5, seed=3)
        loop = LayerLoop(eng.cache, eng, _Scripted(table), True, store.n_layers, store.n_experts, lambda layer: 3,
                         record=True)
        prefill = [list(range(4)), list(range(4, 8))]
        for l in range(store.n_layers):
            loop.run(0, l, prefill, _NoCompute(), topk=torch.tensor(prefill))
        for step, layers in enumerate(rows, start=1):
            loop.provider.step = step - 1
            for l, r in enumerate(layers):
                loop.run(step, l, [r], _NoCompute(), topk=torch.tensor([r]))
    finally:
        for _ in gen:
            pass
    a = sequences_from_record(routing_rows(loop.events), store.n_layers)
    b = sequences_from_record(recorded_routing(SimpleNamespace(events=loop.events)), store.n_layers)
    assert len(a) == len(b) == 1 and len(a[0].steps) == 1 + len(rows)
    for sa, sb in zip(a[0].steps, b[0].steps):
        assert sa.topk == sb.topk
        assert [None if s is None else s.tolist() for s in sa.scores] == \
            [None if s is None else s.tolist() for s in sb.scores]
    assert a[0].steps[0].n_tokens == 2 and a[0].steps[1].scores[0] is not None
    with pytest.raises(Exception, match="not recorded"):
        sequences_from_record([{"step": 0, "layer": 0, "topk": None, "scores": None}], 1)


def test_the_compute_the_io_takes_is_charged_per_demand_load_issuing_layer_and_prefetch() -> None:
    """The profile's fit of how the I/O slows the model's compute (window.fit_interference) is charged by the
    simulator: per load the compute thread performs itself, per layer that issues prefetches and per prefetch a worker
    serves; with instant transfers (decisions that do not depend on time, every issued prefetch served) each adds
    exactly its count times its cost."""
    g = torch.Generator().manual_seed(3)
    steps = [SimStep(topk=[[sorted(torch.randperm(8, generator=g)[:2].tolist())] for _ in range(3)],
                     scores=[torch.rand(8, generator=g), torch.rand(8, generator=g), None]) for _ in range(6)]
    zero = [0.0] * 3

    def run(a: float, b: float, c: float) -> Any:
        prof = ComputeProfile(zero, [1e-4] * 3, zero, [1e-3] * 3, zero, 1e-3, cpu_per_prefetch_s=b,
                              cpu_per_issue_s=a, cpu_per_demand_s=c)
        return simulate([SimSequence(steps)], "specprefetch", 3, 8, 8, 2, prof, StorageProfile("ram", "ram"), 1,
                        fixed_transfer_s=0.0)

    base = run(0.0, 0.0, 0.0)
    dec = [ev for ev in base.events if ev.step > 0]  # the first step is the prefill: not in decode_s
    n_issue, n_pf, n_dem = sum(1 for ev in dec if ev.issued), sum(len(ev.issued) for ev in dec), \
        sum(ev.misses for ev in dec)
    assert n_issue and n_pf > n_issue and n_dem, "the script exercises all three"
    for (a, b, c), count in (((1e-3, 0, 0), n_issue), ((0, 1e-3, 0), n_pf), ((0, 0, 1e-3), n_dem)):
        got = run(a, b, c)
        assert got.decode_s - base.decode_s == pytest.approx(1e-3 * count), (a, b, c)
        assert [ev.issued for ev in got.events] == [ev.issued for ev in base.events]


def test_a_prefetch_costs_the_compute_its_cpu_only_when_a_worker_serves_it() -> None:
    """The per-prefetch CPU is charged as a worker starts the load (at the compute thread's next step), so a queued
    prefetch cancelled before it started costs nothing, as in the runtime (window.step_load counts served ones)."""
    from specprefetch.runtime.simulation.simulator import _SimIO

    cache = ExpertCache(8)
    io = _SimIO(cache, StorageProfile("ram", "ram"), 1, 0.0, 1e-3, worker_cpu_s=0.5e-3)
    for e in range(3):
        cache.reserve((1, e))
        io.submit((1, e), "prefetch", 1)  # one worker: the first starts, two wait in the queue
    assert len(io.cancel_pending(1, keep=set())) == 2
    io.account(1e-4)
    assert io.now() == pytest.approx(1e-4 + 0.5e-3)  # the served one's CPU, once
    io.account(1e-4)
    assert io.now() == pytest.approx(2e-4 + 0.5e-3)


def test_the_compute_thread_runs_again_a_hand_off_after_a_load_it_waited_for() -> None:
    """``wake_s`` (the runtime's measured t_woken - t_end) is charged when the compute thread blocked on a load a
    worker served, not when the load had finished before it asked, nor on a load it performed itself."""
    from specprefetch.runtime.simulation.simulator import _SimIO

    cache = ExpertCache(8)
    io = _SimIO(cache, StorageProfile("ram", "ram"), 1, 0.0, 1e-3, wake_s=0.2e-3)
    cache.reserve((1, 0))
    tr = io.submit((1, 0), "prefetch", 1)  # a worker serves it: 1 ms
    io.wait(tr)
    assert io.now() == pytest.approx(1e-3 + 0.2e-3)
    cache.reserve((1, 1))
    done = io.submit((1, 1), "prefetch", 1)
    io.account(5e-3)
    io.poll()
    io.wait(done)  # finished while the compute ran: no hand-off
    assert io.now() == pytest.approx(1.2e-3 + 5e-3)
    cache.reserve((1, 2))
    own = io.submit((1, 2), "demand", 1)
    assert io.steal((1, 2)) is own
    io.execute(own)  # the compute thread's own load
    assert io.now() == pytest.approx(6.2e-3 + 1e-3)


def test_the_profile_pools_the_measured_hand_offs_over_its_runs() -> None:
    """window.pooled_hand_offs: each hand-off's mean over the runs weighted by its count; 0 with none."""
    from specprefetch.runtime.measurement.window import pooled_hand_offs

    got = pooled_hand_offs([{"waits": 10.0, "wake_ms": 0.5, "starts": 1.0, "start_ms": 2.0},
                            {"waits": 30.0, "wake_ms": 0.9, "starts": 3.0, "start_ms": 0.4}, {"waits": 0.0}])
    assert got == pytest.approx({"wake_ms": 0.8, "start_ms": 0.8})
    assert pooled_hand_offs([{"waits": 0.0, "wake_ms": 0.0}, {}]) == {"wake_ms": 0.0, "start_ms": 0.0}


def test_a_worker_woken_for_a_load_starts_it_a_hand_off_later() -> None:
    """``start_s`` (the runtime's measured t_start - t_offered of a sleeping worker) delays a load a sleeping worker
    takes, not one a busy worker takes next: with one worker, the first of two prefetches ends at start_s + 1 ms, the
    second right after it."""
    from specprefetch.runtime.simulation.simulator import _SimIO

    cache = ExpertCache(8)
    io = _SimIO(cache, StorageProfile("ram", "ram"), 1, 0.0, 1e-3, start_s=0.3e-3)
    cache.reserve((1, 0))
    first = io.submit((1, 0), "prefetch", 1)
    cache.reserve((1, 1))
    second = io.submit((1, 1), "prefetch", 1)
    io.wait(second)
    assert (first.t_start, first.t_end) == pytest.approx((0.3e-3, 1.3e-3))
    assert (second.t_start, second.t_end) == pytest.approx((1.3e-3, 2.3e-3))
    cache.reserve((1, 2))
    own = io.submit((1, 2), "demand", 1)
    assert io.steal((1, 2)) is own
    io.execute(own)  # the compute thread's own load: no worker to wake
    assert own.t_end - own.t_start == pytest.approx(1e-3)


def test_the_profiles_fit_of_the_compute_the_io_takes() -> None:
    """fit_interference recovers the costs a host with known costs would show, and never gives a negative cost."""
    from specprefetch.runtime.measurement.window import fit_interference

    per_demand, per_issue, per_pf = 0.15, 0.5, 0.1

    def load(pred: float, demand: float, issues: float = 0.0, pf: float = 0.0) -> dict[str, float]:
        return {"compute_ms": pred + per_demand * demand + per_issue * issues + per_pf * pf, "demand": demand,
                "issues": issues, "prefetches": pf}

    resident, off, predicting = load(30.0, 0.0), load(30.0, 45.0), load(31.0, 45.0)
    fit = fit_interference(resident, off, predicting, [load(31.0, 40.0, 10.0, 10.0), load(31.0, 30.0, 10.0, 55.0)])
    assert fit == pytest.approx({"cpu_per_demand_ms": per_demand, "cpu_per_issue_ms": per_issue,
                                 "cpu_per_prefetch_ms": per_pf})
    # more prefetches made the compute faster: no negative cost, the one cost that fits best alone
    fewer = {"compute_ms": 40.0, "demand": 45.0, "issues": 10.0, "prefetches": 10.0}
    odd = fit_interference(resident, off, predicting, [fewer, {**fewer, "compute_ms": 38.0, "prefetches": 55.0}])
    assert min(odd.values()) >= 0.0 and (odd["cpu_per_issue_ms"] == 0.0 or odd["cpu_per_prefetch_ms"] == 0.0)
    none = fit_interference(resident, load(29.0, 0.0), predicting, [])
    assert none == {"cpu_per_demand_ms": 0.0, "cpu_per_issue_ms": 0.0, "cpu_per_prefetch_ms": 0.0}
