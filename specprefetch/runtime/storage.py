"""Storage profiles: where a missing expert is read from, and how long the read is made to take.

Profiles (the ``storage`` column of ``runs.csv``):

- ``nvme_cold``: the physical local disk with a cold page cache. Before every run the store's pages are evicted
  (``posix_fadvise(POSIX_FADV_DONTNEED)``) and, by default, each record's pages again right after it is read,
  so every load is a real device read (the phone setting, where RAM is too small to cache the experts).
- ``ram``: the experts mirrored in host memory (pinned on CUDA): a load is a memory copy (the classic
  CPU-offload setting). No delay is added.
- emulated ``nvme``, ``ufs``, ``slow_ufs``, ``sdcard``: the record is read from the store file (page cache) and
  the load is held back until the time a device with that bandwidth and per-request latency would need
  (:class:`BandwidthModel`), as the paper emulates slower storage by controlled loading delays.

Defaults (QD1 random reads of ~2 MB records; datasheet-level numbers of phone-class devices):

==========  ===============  ==========  ======================================
profile     bandwidth MB/s   latency ms  device it stands for
==========  ===============  ==========  ======================================
nvme        3500             0.08        PCIe 4 NVMe / UFS 4.0
ufs         1700             0.15        UFS 3.1
slow_ufs    750              0.30        UFS 2.1
sdcard      90               1.00        UHS-I A2 microSD
==========  ===============  ==========  ======================================

A load's emulated time is ``scale * (latency + charged_bytes / bandwidth)``. ``charged_bytes`` is the real record
payload (``charge: real``), the paper's 4-bit DeepSeek-VL2-Tiny expert, 1.94 MB (``charge: paper``), or
``paper`` with ``scale`` calibrated so that the profiled compute window over one emulated-NVMe transfer equals
the paper's budget ratio (``charge: calibrated``): the tiny stand-ins compute ~20x faster per layer than the
phone, so this keeps the window-to-transfer ratio, the quantity prefetching depends on, in the paper's regime
while the other profiles keep their speed relative to NVMe.

Loads issued during prefill (a step of several tokens) are not held back: the benchmarks measure decoding
throughput, which excludes prefill, so charging the emulated delay there would only lengthen every run (an SD-card
run's prefill took longer than its decoding). The runtime and the simulator both start charging at the first
decoding step; ``nvme_cold`` reads are physical throughout.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from specprefetch.contracts import STORAGES
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.store import ExpertStore

log = logging.getLogger(__name__)



class StorageError(SpecPrefetchError):
    """A storage profile is unknown or misconfigured."""


@dataclass(frozen=True)
class StorageProfile:
    """One storage setting: kind ('physical', 'ram', 'emulated') and, if emulated, its device model."""

    name: str
    kind: str
    bandwidth_mbps: float = 0.0
    latency_ms: float = 0.0
    charged_bytes: float = 0.0   # bytes each expert load is charged as (emulated profiles)
    scale: float = 1.0           # time scale of the emulation (calibrated charge)
    cold_each_read: bool = True  # nvme_cold: evict a record's pages right after reading it

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"

    def transfer_s(self, nbytes: float | None = None) -> float:
        """Modelled time of one isolated load (emulated profiles); 0 for the others (they are measured)."""
        if not self.emulated:
            return 0.0
        b = self.charged_bytes if nbytes is None else nbytes
        return self.scale * (self.latency_ms * 1e-3 + b / (self.bandwidth_mbps * 1e6))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bandwidth_mbps": self.bandwidth_mbps,
                "latency_ms": self.latency_ms, "charged_bytes": self.charged_bytes, "scale": self.scale,
                "transfer_ms": self.transfer_s() * 1e3}


def make_profile(name: str, device_cfg: dict[str, Any], payload_bytes: int = 0,
                 scale: float = 1.0) -> StorageProfile:
    """The profile ``name`` with the resolved ``device`` section's numbers (``storage_profiles``) and charge mode."""
    cfg = device_cfg
    if name not in STORAGES:
        raise StorageError(f"unknown storage profile {name!r}; known: {', '.join(STORAGES)}")
    if name == "nvme_cold":
        return StorageProfile(name, "physical", cold_each_read=bool(cfg["cold_each_read"]))
    if name == "ram":
        return StorageProfile(name, "ram")
    numbers = cfg["storage_profiles"][name]
    bw, lat = float(numbers["bandwidth_mbps"]), float(numbers["latency_ms"])
    if bw <= 0 or lat < 0:
        raise StorageError(f"invalid config key 'device.storage_profiles.{name}': bandwidth_mbps must be > 0 "
                           f"and latency_ms >= 0 (got {bw}, {lat})")
    charge = cfg["charge"]
    if charge == "real":
        charged = float(payload_bytes)
    elif charge in ("paper", "calibrated"):
        charged = float(cfg["paper_expert_mb"]) * 1e6
    else:
        raise StorageError(f"invalid config key 'device.charge': {charge!r} (real, paper or calibrated)")
    return StorageProfile(name, "emulated", bw, lat, charged, scale if charge == "calibrated" else 1.0)


class BandwidthModel:
    """A storage device as the emulation and the simulator see it.

    Requests are served in the order they reach the device; each occupies the shared bandwidth for
    ``bytes / bandwidth`` and completes ``latency`` after its data phase (latency is pipelined, so concurrent
    requests overlap their latencies but not their data). Isolated request: ``latency + bytes / bandwidth``.
    """

    def __init__(self, profile: StorageProfile) -> None:
        self.profile = profile
        self.lock = threading.Lock()
        self.free_at = 0.0

    def reset(self) -> None:
        with self.lock:
            self.free_at = 0.0

    def schedule(self, now: float, nbytes: float | None = None) -> float:
        """Reserve the device for one request issued at ``now``; return its completion time."""
        p = self.profile
        b = p.charged_bytes if nbytes is None else nbytes
        data = p.scale * b / (p.bandwidth_mbps * 1e6)
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + data
            return self.free_at + p.scale * p.latency_ms * 1e-3


class FaultInjector:
    """Makes chosen reads fail with EIO (tests, robustness runs): a seeded rate, optionally capped."""

    def __init__(self, rate: float = 0.0, seed: int = 0, max_failures: int | None = None,
                 fail_keys: set[tuple[int, int]] | None = None) -> None:
        self.rate = float(rate)
        self.rng = random.Random(seed)
        self.max_failures = max_failures
        self.fail_keys = set(fail_keys or ())
        self.failures = 0
        self.lock = threading.Lock()

    def check(self, layer: int, expert: int) -> None:
        with self.lock:
            if self.max_failures is not None and self.failures >= self.max_failures:
                return
            hit = (layer, expert) in self.fail_keys or (self.rate > 0 and self.rng.random() < self.rate)
            if hit:
                self.failures += 1
        if hit:
            raise OSError(5, f"injected I/O error reading expert {expert} of layer {layer}")


class ExpertReader:
    """Reads expert records into host buffers under one storage profile (thread-safe)."""

    def __init__(self, store: ExpertStore, profile: StorageProfile, faults: FaultInjector | None = None,
                 verify: bool = False, pin_memory: bool = False) -> None:
        self.store = store
        self.profile = profile
        self.faults = faults
        self.verify = verify
        self.model = BandwidthModel(profile) if profile.emulated else None
        self.fds = [os.open(f, os.O_RDONLY) for f in store.files]
        self.mirror: torch.Tensor | None = None
        self.mirror_views: list[list[memoryview]] | None = None
        self.cold_each_read = profile.kind == "physical" and profile.cold_each_read
        if profile.kind == "ram":
            self.mirror = self._load_mirror(pin_memory)
            self.mirror_views = [[memoryview(self.mirror[l, e].numpy()).cast("B") for e in range(store.n_experts)]
                                 for l in range(store.n_layers)]

    def _load_mirror(self, pin: bool) -> torch.Tensor:
        rb = self.store.record_bytes
        t = torch.empty(self.store.n_layers, self.store.n_experts, rb, dtype=torch.uint8)
        if pin:
            t = t.pin_memory()
        for layer in range(self.store.n_layers):
            view = memoryview(t[layer].numpy()).cast("B")
            got = os.preadv(self.fds[layer], [view], 0)
            if got != rb * self.store.n_experts:
                raise StorageError(f"{self.store.files[layer]}: short read ({got} bytes) while mirroring into RAM")
        return t

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def __del__(self) -> None:  # pragma: no cover - best effort
        self.close()

    def prepare_run(self) -> None:
        """Start of a run: cold profile evicts the store's pages; emulated device becomes idle with the store in
        the page cache (so the modelled delay, not a physical read, sets the time of every emulated load)."""
        if self.profile.kind == "physical":
            self.evict_all()
        if self.model is not None:
            self.warm_page_cache()
            self.model.reset()

    def warm_page_cache(self, max_fraction_of_ram: float = 0.25) -> bool:
        """Read the store once so its pages are cached (skipped, with a warning, for a store too big for RAM)."""
        size = self.store.record_bytes * self.store.total_experts
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # pragma: no cover - non-POSIX
            ram = 0
        if ram and size > max_fraction_of_ram * ram:
            log.warning("expert store of %.1f GB is too large to keep in the page cache: emulated loads may include "
                        "physical reads", size / 1e9)
            return False
        buf = bytearray(1 << 22)
        for fd in self.fds:
            off = 0
            while True:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
        return True

    def evict_all(self) -> None:
        if not hasattr(os, "posix_fadvise"):  # pragma: no cover - non-Linux
            log.warning("posix_fadvise unavailable: nvme_cold cannot evict the page cache")
            return
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def source(self, layer: int, expert: int) -> torch.Tensor | None:
        """A RAM-mirrored record (profile ``ram``) to copy from directly, else None."""
        return None if self.mirror is None else self.mirror[layer, expert]

    def read(self, layer: int, expert: int, dest: torch.Tensor, view: memoryview | None = None,
             charged: bool = True) -> None:
        """Fill ``dest`` (uint8 host tensor of record_bytes; ``view``: its bytes, if the caller has them) with
        the record; blocks for the emulated time (unless not ``charged``: a prefill load, which is not measured)."""
        t0 = time.perf_counter()
        finish = self.model.schedule(t0) if self.model is not None and charged else 0.0
        if self.faults is not None:
            self.faults.check(layer, expert)
        rb = self.store.record_bytes
        if view is None:
            view = memoryview(dest.numpy()).cast("B")
        if self.mirror_views is not None:
            view[:] = self.mirror_views[layer][expert]
        else:
            off = expert * rb
            got = os.preadv(self.fds[layer], [view], off)
            if got != rb:
                raise OSError(5, f"{self.store.files[layer]}: short read of expert {expert} ({got}/{rb} bytes)")
            if self.cold_each_read:
                os.posix_fadvise(self.fds[layer], off, rb, os.POSIX_FADV_DONTNEED)
        if self.verify:
            self.store.check_record(layer, expert, view)
        if finish:
            remaining = finish - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)


def measure_transfer_ms(reader: ExpertReader, n: int = 64, seed: int = 0) -> list[float]:
    """Isolated (one at a time) load times of ``n`` random experts under the reader's profile, in ms."""
    rng = random.Random(seed)
    buf = torch.empty(reader.store.record_bytes, dtype=torch.uint8)
    reader.prepare_run()
    out = []
    for _ in range(n):
        layer, expert = rng.randrange(reader.store.n_layers), rng.randrange(reader.store.n_experts)
        if reader.profile.kind == "physical":
            os.posix_fadvise(reader.fds[layer], reader.store.offset(expert), reader.store.record_bytes,
                             os.POSIX_FADV_DONTNEED)
        if reader.model is not None:
            reader.model.reset()
        t0 = time.perf_counter()
        reader.read(layer, expert, buf)
        out.append((time.perf_counter() - t0) * 1e3)
    return out
