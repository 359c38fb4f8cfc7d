"""The two storage emulations (``device.emulation``) and the two I/O orders (``device.io_order``), issue 28.

- ``delay`` (the paper's): a physical cold read plus a per-load delay derived from the datasheet, delays of
  concurrent loads overlapping; ``bandwidth``: a shared device serving loads in turn.
- ``demand_first``: a demand load goes before queued prefetches; ``fifo``: loads in the order they were issued.

Both hold in the runtime's I/O backend and in the simulator's, and the one per-layer loop makes the same decisions
over either under each order.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from specprefetch.config import section_defaults
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.cache import ExpertCache, SlotPool
from specprefetch.runtime.core.storage import (
    ExpertReader,
    StorageProfile,
    delayed_device,
    emulation_delay_ms,
    host_buffer,
    make_profile,
)
from specprefetch.runtime.core.store import ExpertStore, build_expert_store
from specprefetch.runtime.core.transfer import TransferEngine
from specprefetch.runtime.simulation.platforms import platform_profile, platform_storage
from specprefetch.runtime.simulation.simulator import _SimIO

MB = 1e6


def _device(**over: Any) -> dict[str, Any]:
    return {**section_defaults("device"), **over}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    from tests.test_runtime import tiny_qwen

    return ExpertStore(build_expert_store(tiny_qwen(), tmp_path_factory.mktemp("store") / "experts", model_name="t"))


# ------------------------------------------------------------------------------------------ the profiles
def test_delay_is_the_datasheet_time_beyond_the_physical_read() -> None:
    """slow_ufs (850 MB/s, 0.2 ms) for a 1.94 MB record: 0.2 + 1.94e6 / 850e6 s = 2.482 ms; on a disk that reads
    the record in 1.0 ms the delay is 1.482 ms; on one slower than the datasheet device it is 0."""
    cfg = _device()
    assert cfg["emulation"] == "delay" and cfg["io_order"] == "demand_first"  # the paper's method is the default
    prof = make_profile("slow_ufs", cfg, int(1.94 * MB), 1.0)
    assert prof.delayed and not prof.modelled and prof.reads_disk
    assert prof.transfer_s() * 1e3 == pytest.approx(0.2 + 1.94 / 0.85)
    assert prof.delay_ms == pytest.approx(0.2 + 1.94 / 0.85 - 1.0)
    assert make_profile("slow_ufs", cfg, int(1.94 * MB), 5.0).delay_ms == 0.0
    assert emulation_delay_ms(prof, 0.0) == pytest.approx(prof.transfer_s() * 1e3)
    # the physical read is measured only where a delay needs it
    calls: list[int] = []

    def measure() -> float:
        calls.append(1)
        return 1.0

    make_profile("nvme_cold", cfg, 100, measure)
    make_profile("slow_ufs", _device(emulation="bandwidth"), 100, measure)
    assert not calls
    assert make_profile("ufs", cfg, int(1.94 * MB), measure).delay_ms > 0 and calls == [1]


def test_bandwidth_emulation_is_the_shared_device_and_delay_needs_a_physical_read() -> None:
    prof = make_profile("slow_ufs", _device(emulation="bandwidth"), int(1.94 * MB))
    assert prof.modelled and not prof.delayed and not prof.reads_disk and prof.delay_ms == 0.0
    with pytest.raises(SpecPrefetchError, match="slow_ufs: device.emulation 'delay' adds to a physical read"):
        make_profile("slow_ufs", _device(), int(1.94 * MB))
    with pytest.raises(SpecPrefetchError, match="finite number >= 0"):
        make_profile("slow_ufs", _device(), int(1.94 * MB), float("nan"))


def test_the_delay_emulation_as_the_simulator_models_it() -> None:
    """The physical disk's model with the delay on its pipelined latency: four loads issued together share the
    disk's bandwidth but overlap their delays (done at 4 x data + latency + delay), where the bandwidth emulation
    serves them one after another at the datasheet bandwidth (done at 4 x datasheet data + latency)."""
    disk = StorageProfile("nvme_cold", "emulated", 2000.0, 0.1, 2 * MB)          # 1 ms data per record
    slow = make_profile("sdcard", _device(), int(2 * MB), disk.transfer_s() * 1e3)  # 90 MB/s, 1 ms latency
    model = delayed_device(disk, slow)
    assert model.name == "sdcard" and model.latency_ms == pytest.approx(0.1 + slow.delay_ms)
    assert model.transfer_s() == pytest.approx(slow.transfer_s())  # an isolated load: the datasheet time

    def done(prof: StorageProfile) -> list[float]:
        io = _SimIO(ExpertCache(8), prof, 4, 0.0, None)
        trs = []
        for e in range(4):
            io.cache.reserve((0, e))
            trs.append(io.submit((0, e), "prefetch", 0))
        io.drain()
        return [tr.t_end for tr in trs]

    assert max(done(model)) == pytest.approx(4e-3 + (0.1 + slow.delay_ms) * 1e-3)
    bw = make_profile("sdcard", _device(emulation="bandwidth"), int(2 * MB))
    assert max(done(bw)) == pytest.approx(4 * 2 / 90 + 1e-3)
    assert max(done(model)) < max(done(bw)) / 3


def test_a_simulated_platform_adds_the_delay_to_its_own_nvme() -> None:
    p = platform_profile("snapdragon_8_elite")
    nvme = platform_storage(p, "nvme_cold", _device(), 1500.0)
    ufs = platform_storage(p, "slow_ufs", _device(), 1500.0)
    assert ufs.bandwidth_mbps == nvme.bandwidth_mbps and ufs.latency_ms > nvme.latency_ms
    assert ufs.transfer_s() == pytest.approx(max(nvme.transfer_s(), make_profile(
        "slow_ufs", _device(), int(p["expert_mb"] * MB), 0.0).transfer_s()))
    assert platform_storage(p, "slow_ufs", _device(emulation="bandwidth"), 1500.0).bandwidth_mbps == 850.0


# ------------------------------------------------------------------------------------------ the reader
def test_a_delayed_load_reads_the_disk_and_then_waits_its_delay(store: ExpertStore) -> None:
    """Under ``delay`` the reader reads the record from the disk, cold (as nvme_cold), bytes intact, and no load
    completes before its delay; there is no shared device model (concurrent loads overlap their delays)."""
    prof = make_profile("slow_ufs", _device(), store.layout.payload_bytes, 0.0)
    prof = StorageProfile(**{**prof.__dict__, "delay_ms": 20.0})
    reader = ExpertReader(store, prof)
    plain = ExpertReader(store, make_profile("ram", _device()))
    try:
        assert reader.model is None and reader.cold_read_mode in ("direct", "fadvise")
        reader.prepare_run()
        a, b = host_buffer(store.record_bytes), host_buffer(store.record_bytes)
        t0 = time.perf_counter()
        reader.load(1, 3, a)
        assert time.perf_counter() - t0 >= 0.020
        plain.load(1, 3, b)
        assert torch.equal(a, b)
        t0 = time.perf_counter()
        reader.load(1, 4, a, charged=False)  # a prefill load is not charged: no delay (and it still reads)
        plain.load(1, 4, b)
        assert torch.equal(a, b)
    finally:
        reader.close()
        plain.close()


# ------------------------------------------------------------------------------------------ the I/O order
def _ram_engine(store: ExpertStore, capacity: int, io_order: str) -> tuple[TransferEngine, ExpertReader]:
    reader = ExpertReader(store, make_profile("ram", _device(io_order=io_order), store.layout.payload_bytes))
    eng = TransferEngine(reader, ExpertCache(capacity), SlotPool(capacity, store.layout, torch.device("cpu")), 1, 0)
    return eng, reader


def _sim(capacity: int, io_order: str) -> _SimIO:
    return _SimIO(ExpertCache(capacity), StorageProfile("ram", "ram", demand_first=io_order == "demand_first"),
                  1, 0.0, 1e-3)


@pytest.mark.parametrize("backend", ["engine", "sim"])
@pytest.mark.parametrize("io_order", ["demand_first", "fifo"])
def test_a_demand_load_behind_queued_prefetches(store: ExpertStore, backend: str, io_order: str) -> None:
    """Two prefetches queued, then a demand load: under demand_first the compute thread performs it at once (and
    a needed prefetch is promoted ahead of the other); under fifo it may not overtake them and nothing is promoted."""
    if backend == "engine":
        io, reader = _ram_engine(store, 8, io_order)
    else:
        io, reader = _sim(8, io_order), None
    fifo = io_order == "fifo"
    try:
        cache = io.cache
        with cache.lock:  # the engine's one worker takes nothing while the lock is held
            cache.reserve((0, 0))
            busy = io.submit((0, 0), "prefetch", 0)
            if backend == "sim":
                assert busy.state == "running"  # the one worker is on it
            cache.reserve((1, 1))
            p1 = io.submit((1, 1), "prefetch", 0)
            cache.reserve((1, 2))
            p2 = io.submit((1, 2), "prefetch", 0)
            cache.reserve((1, 3))
            d = io.submit((1, 3), "demand", 0)
            io.promote((1, 2))
            assert (p2.cls == p1.cls) is fifo  # promoted only under demand_first
            # under fifo the demand load may not overtake the prefetches queued before it
            assert io.steal((1, 3)) is (None if fifo else d)
        if d.state == "running":
            io.execute(d)
        else:
            io.wait(d)
        io.drain()
        assert all(cache.is_resident(k) for k in ((0, 0), (1, 1), (1, 2), (1, 3)))
        if backend == "sim":  # virtual clock, 1 ms a load: the order is visible in the completion times
            if fifo:
                assert busy.t_end < p1.t_end < p2.t_end < d.t_end
            else:
                assert d.t_end < p2.t_end < p1.t_end
    finally:
        if reader is not None:
            io.shutdown()
            reader.close()


def test_under_fifo_the_waiting_thread_claims_its_demand_load_once_the_loads_before_it_started(
        store: ExpertStore) -> None:
    """FIFO, one worker busy with the prefetch issued first: the demand load queued behind it is performed by the
    compute thread as soon as that prefetch has started, not left for the worker after it finishes."""
    import threading

    io, reader = _ram_engine(store, 8, "fifo")
    release, started = threading.Event(), threading.Event()
    load = io._load

    def slow_load(tr: Any, slot: int, stream: Any = None) -> None:
        if tr.kind == "prefetch":
            started.set()
            release.wait(10)
        load(tr, slot, stream)

    io._load = slow_load
    try:
        cache = io.cache
        with cache.lock:  # the worker takes nothing while the lock is held
            cache.reserve((1, 1))
            p = io.submit((1, 1), "prefetch", 0)
            cache.reserve((1, 2))
            d = io.submit((1, 2), "demand", 0)
            assert io.steal((1, 2)) is None  # it may not overtake the prefetch issued before it
        waiter = threading.Thread(target=io.wait, args=(d,), daemon=True)
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive(), "the compute thread waited for the busy worker instead of claiming its load"
        assert started.is_set() and p.state == "running" and d.state == "pending"
        assert io.steal((1, 2)) is d
        io.execute(d)
        assert d.inline and d.state == "done" and p.state == "running"
    finally:
        release.set()
        io.drain()
        io.shutdown()
        reader.close()


def test_the_simulator_claims_a_fifo_demand_load_when_the_woken_worker_has_started_the_load_before_it() -> None:
    """The same on the virtual clock: a worker woken for the prefetch starts it ``start_s`` after; the demand load
    issued behind it may not start before that, and then the compute thread performs it (1 ms a load)."""
    sim = _SimIO(ExpertCache(8), StorageProfile("ram", "ram", demand_first=False), 2, 0.0, 1e-3, start_s=0.5e-3)
    sim.cache.reserve((1, 1))
    p = sim.submit((1, 1), "prefetch", 0)
    sim.cache.reserve((1, 2))
    d = sim.submit((1, 2), "demand", 0)
    assert p.t_start == pytest.approx(0.5e-3)
    assert sim.steal((1, 2)) is None  # the prefetch has not started yet
    sim.wait(d)
    assert d.state == "pending" and sim.clock == pytest.approx(0.5e-3)
    assert sim.steal((1, 2)) is d
    sim.execute(d)
    assert d.t_start == pytest.approx(0.5e-3) and d.t_end == pytest.approx(1.5e-3)


@pytest.mark.parametrize("compute_opt", [True, False])
def test_one_loop_makes_the_same_decisions_under_fifo(store: ExpertStore, compute_opt: bool) -> None:
    """The loop over the threaded engine and over the discrete-event backend, both FIFO: the same decisions."""
    from tests.test_loop import _drive

    eng, reader = _ram_engine(store, 7, "fifo")
    try:
        a = _drive(eng, eng.cache, compute_opt, store)
    finally:
        eng.shutdown()
        reader.close()
    sim = _sim(7, "fifo")
    b = _drive(sim, sim.cache, compute_opt, store)
    fields = ("step", "layer", "required", "hits", "inflight", "misses", "ready_pairs", "candidates", "issued",
              "prefetch_used", "prefetch_wasted", "prefetch_cancelled")
    assert [[getattr(e, f) for f in fields] for e in a] == [[getattr(e, f) for f in fields] for e in b]
    assert sum(e.prefetch_used for e in a) > 0


def test_a_window_profiles_overshoot_may_be_negative_its_times_not() -> None:
    """Under the delay emulation a storage's isolated reads vary around its intended time (the physical read's
    median plus the delay), so its measured overshoot may be negative; a transfer time may not."""
    from specprefetch.contracts import ContractError, check_window_profile

    entry = {"transfer_ms": 1.1, "model_ms": 1.2, "overshoot_ms_mean": -0.4, "overshoot_ms_p95": 0.2, "n": 64}
    check_window_profile({"transfer_ms": {"nvme": entry}}, "profile.json")
    with pytest.raises(ContractError, match=r"transfer_ms.nvme.transfer_ms"):
        check_window_profile({"transfer_ms": {"nvme": {**entry, "transfer_ms": -1.0}}}, "profile.json")
    with pytest.raises(ContractError, match=r"transfer_ms.nvme.model_ms"):
        check_window_profile({"transfer_ms": {"nvme": {**entry, "model_ms": -1.0}}}, "profile.json")
