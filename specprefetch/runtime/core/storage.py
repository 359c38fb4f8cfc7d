"""Storage profiles: where a missing expert is read from, and how long the read takes.

Profiles (the ``storage`` column of ``runs.csv``):

- ``nvme_cold``: the physical local disk, cold. Reads bypass the page cache (``O_DIRECT`` into page-aligned
  buffers, so every load is a real device read: the phone setting, where RAM is too small to cache the experts).
  A direct read lands in a *staging buffer* (:meth:`ExpertReader.staging`: long-lived, page-aligned, pinned on
  CUDA, shared by every run of the reader) and is then copied into its cache slot, as the CUDA path copies it to
  the GPU. On the reference VM ``O_DIRECT`` reads into some freshly allocated buffers ran about twice as slow as
  into others, persistently per buffer, while a copy into them did not; a run's own cache memory would otherwise
  set its read speed, which pairing across runs cannot remove.
  Where the file system refuses ``O_DIRECT`` (tmpfs, some overlays) the reader falls back, with a logged warning,
  to ``POSIX_FADV_RANDOM`` reads whose pages are evicted (``POSIX_FADV_DONTNEED``) before the run and after each
  read; the mode used is recorded (``cold_read_mode``).
- ``ram``: the experts mirrored in host memory (pinned on CUDA): a load is a memory copy (the classic
  CPU-offload setting).
- emulated ``nvme``, ``ufs``, ``slow_ufs``, ``sdcard``: a slower device of the given sequential-read bandwidth and
  per-request latency, in one of two emulations (``device.emulation``):

  - ``delay`` (the paper's: "controlled loading delays", default): every load is a real cold read from the physical
    disk (as ``nvme_cold``) followed by a controlled delay of its own. The delay is what the datasheet device needs
    for this record beyond what this host's disk took: ``delay = max(0, latency + payload / bandwidth - t_phys)``,
    with ``t_phys`` the median isolated cold read of one record measured on this host (the window profile's, or
    measured when the reader is made: :func:`physical_read_ms`). Concurrent loads overlap their delays (no shared
    queue beyond the physical disk's own), so the emulation tests sensitivity to storage latency, as the paper's
    Figure 5 says it does, not bandwidth contention.
  - ``bandwidth``: a shared device (:class:`BandwidthModel`): each load occupies the device's bandwidth for
    ``payload / bandwidth`` in turn and completes ``latency`` after that; the load reads the real bytes it delivers
    from the page cache (the CPU and memory traffic of a read).

  Either way a load completes when the emulation says: it sleeps, then yields the CPU (``sched_yield``) for the last
  ``SPIN_S`` so that it is on time (the overshoot is measured by ``profile-window`` and reported).

Emulated devices (defaults of ``device.storage_profiles``; sequential read from the vendors' datasheets, the
latency an estimate of one QD1 request of an expert-sized read):

==========  ===============  ==========  ================================================================
profile     bandwidth MB/s   latency ms  device (datasheet sequential read)
==========  ===============  ==========  ================================================================
nvme        4200             0.08        UFS 4.0 (Samsung, "up to 4,200 MB/s"), PCIe 4 NVMe class
ufs         2100             0.12        UFS 3.1 (Samsung, "up to 2,100 MB/s")
slow_ufs    850              0.20        UFS 2.1 (Samsung, "up to 850 MB/s")
sdcard      90               1.00        microSD UHS-I (bus limit 104 MB/s; A2 cards ~90 MB/s)
==========  ===============  ==========  ================================================================

A load's time is ``latency + payload_bytes / bandwidth`` with the store's real payload: nothing is scaled to a
target ratio, so the window-to-transfer ratio that decides prefetching is the measured one.

Under ``device.io_order: demand_first`` (the default) demand loads go first at the modelled device: a demand load
issued while prefetches wait for the device's bandwidth is served before every prefetch whose data phase has not
started (those move back); a data phase already under way is not interrupted. Under ``fifo`` requests are served in
the order they were issued.

Loads issued during prefill (a step of several tokens) are not held back: the benchmarks measure decoding
throughput, which excludes prefill. The runtime and the simulator both start charging at the first decoding
step; ``nvme_cold`` reads are physical throughout.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specprefetch import registry
from specprefetch.contracts import STORAGES
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.store import ExpertStore

log = logging.getLogger(__name__)

SPIN_S = 0.2e-3  # an emulated load sleeps until this long before its completion (> the ~60 µs sleep overshoot),
#                 then yields the CPU (sched_yield, GIL released) until it: measured overshoot ~2 µs


class StorageError(SpecPrefetchError):
    """A storage profile is unknown or misconfigured."""


@dataclass(frozen=True)
class StorageProfile:
    """One storage setting: kind ('physical', 'ram', 'emulated') and, if emulated, its device model and emulation
    ('bandwidth': a shared :class:`BandwidthModel`; 'delay': a physical read plus ``delay_ms``)."""

    name: str
    kind: str
    bandwidth_mbps: float = 0.0
    latency_ms: float = 0.0
    charged_bytes: float = 0.0   # bytes each expert load moves (the store's payload)
    cold_each_read: bool = True  # nvme_cold fallback: evict a record's pages right after reading it
    emulation: str = "bandwidth"
    delay_ms: float = 0.0        # 'delay': added after each load's physical read
    demand_first: bool = True    # device.io_order: a demand load goes before queued prefetches (False: FIFO)

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"

    @property
    def delayed(self) -> bool:
        """An emulated device in the paper's emulation: a physical read plus a controlled delay per load."""
        return self.emulated and self.emulation == "delay"

    @property
    def modelled(self) -> bool:
        """Its loads' times come from a shared :class:`BandwidthModel` (the ``bandwidth`` emulation)."""
        return self.emulated and self.emulation == "bandwidth"

    @property
    def reads_disk(self) -> bool:
        """Every load is a cold read from the physical disk (``nvme_cold`` and the ``delay`` emulation)."""
        return self.kind == "physical" or self.delayed

    def transfer_s(self, nbytes: float | None = None) -> float:
        """The datasheet time of one isolated load (emulated profiles); 0 for the others (they are measured)."""
        if not self.emulated:
            return 0.0
        b = self.charged_bytes if nbytes is None else nbytes
        return self.latency_ms * 1e-3 + b / (self.bandwidth_mbps * 1e6)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bandwidth_mbps": self.bandwidth_mbps,
                "latency_ms": self.latency_ms, "charged_bytes": self.charged_bytes,
                "transfer_ms": self.transfer_s() * 1e3, "emulation": self.emulation if self.emulated else None,
                "delay_ms": self.delay_ms if self.delayed else None}


def emulation_delay_ms(profile: StorageProfile, physical_ms: float) -> float:
    """The ``delay`` emulation's per-load delay: the extra time the datasheet device needs for this record beyond the
    physical read it adds to (``physical_ms``, an isolated cold read of one record on this host), at least 0."""
    if not (physical_ms >= 0 and math.isfinite(physical_ms)):
        raise StorageError(f"{profile.name}: the physical read time the delay is derived from must be a finite "
                           f"number >= 0 ms (got {physical_ms})")
    return max(0.0, profile.transfer_s() * 1e3 - physical_ms)


def delayed_device(physical: StorageProfile, profile: StorageProfile) -> StorageProfile:
    """The ``delay`` emulation of ``profile`` as a device model (the simulator's): the physical disk's model with the
    per-load delay added to its pipelined latency (concurrent loads overlap their delays, not their data)."""
    return replace(physical, name=profile.name, latency_ms=physical.latency_ms + profile.delay_ms,
                   demand_first=profile.demand_first)


def make_profile(name: str, device_cfg: dict[str, Any], payload_bytes: int = 0,
                 physical_ms: float | Callable[[], float] | None = None) -> StorageProfile:
    """The profile ``name`` with the resolved ``device`` section's numbers (``storage_profiles``, ``emulation``,
    ``io_order``). An emulated profile under the ``delay`` emulation needs ``physical_ms`` (or a function that
    measures it, called only then): the isolated cold read of one record on this host, which its delay adds to."""
    cfg = device_cfg
    if name not in STORAGES:
        raise StorageError(f"unknown storage profile {name!r}; known: {', '.join(STORAGES)}")
    kind = registry.storage(name).kind
    demand_first = cfg.get("io_order", "demand_first") == "demand_first"
    if kind == "physical":
        return StorageProfile(name, "physical", cold_each_read=bool(cfg["cold_each_read"]), demand_first=demand_first)
    if kind == "ram":
        return StorageProfile(name, "ram", demand_first=demand_first)
    if name not in cfg["storage_profiles"]:
        raise StorageError(f"invalid config key 'device.storage_profiles': no numbers for emulated storage {name!r} "
                           "(the schema's defaults are filled in by config.validate_config)")
    numbers = cfg["storage_profiles"][name]
    bw, lat = float(numbers["bandwidth_mbps"]), float(numbers["latency_ms"])
    if bw <= 0 or lat < 0:
        raise StorageError(f"invalid config key 'device.storage_profiles.{name}': bandwidth_mbps must be > 0 "
                           f"and latency_ms >= 0 (got {bw}, {lat})")
    emulation = str(cfg.get("emulation", "bandwidth"))
    prof = StorageProfile(name, "emulated", bw, lat, float(payload_bytes), emulation=emulation,
                          demand_first=demand_first)
    if emulation != "delay":
        return prof
    if physical_ms is None:
        raise StorageError(f"{name}: device.emulation 'delay' adds to a physical read, and no physical read time "
                           "was given")
    return replace(prof, delay_ms=emulation_delay_ms(prof, physical_ms() if callable(physical_ms) else physical_ms))


@dataclass(eq=False)
class Reservation:
    """One request at the modelled device: its data phase ``[start, end)``, done ``latency`` after ``end``."""

    submit: float
    data_s: float
    demand: bool
    start: float = 0.0
    end: float = 0.0
    latency_s: float = 0.0

    @property
    def done_at(self) -> float:
        return self.end + self.latency_s


@dataclass
class BandwidthModel:
    """A storage device as the emulation and the simulator see it.

    Each request occupies the shared bandwidth for ``bytes / bandwidth`` (its data phase) and completes
    ``latency`` after it (latency is pipelined, so concurrent requests overlap their latencies but not their
    data). Data phases are served in order of arrival, except that a demand request goes before every prefetch
    whose data phase has not started (they move back; see the module docstring). Isolated request:
    ``latency + bytes / bandwidth``.
    """

    profile: StorageProfile
    lock: threading.Lock = field(default_factory=threading.Lock)
    queue: list[Reservation] = field(default_factory=list)  # data phase not yet over, in service order

    def reset(self) -> None:
        with self.lock:
            self.queue = []

    def reserve(self, now: float, nbytes: float | None = None, demand: bool = False) -> Reservation:
        """Queue one request issued at ``now``; its (current) times are in the returned reservation."""
        p = self.profile
        b = p.charged_bytes if nbytes is None else nbytes
        r = Reservation(now, b / (p.bandwidth_mbps * 1e6), demand, latency_s=p.latency_ms * 1e-3)
        with self.lock:
            self.queue = [q for q in self.queue if q.end > now]
            at = len(self.queue)
            if demand and p.demand_first:  # before the first prefetch not yet transferring
                at = next((i for i, q in enumerate(self.queue) if not q.demand and q.start > now), at)
            self.queue.insert(at, r)
            t = self.queue[at - 1].end if at else now  # service order: the ones before ``at`` keep their times
            for q in self.queue[at:]:
                q.start = max(t, q.submit)
                q.end = q.start + q.data_s
                t = q.end
        return r

    def schedule(self, now: float, nbytes: float | None = None, demand: bool = False) -> float:
        """Reserve the device for one request issued at ``now``; return its completion time as of now."""
        return self.reserve(now, nbytes, demand).done_at

    def done_at(self, r: Reservation) -> float:
        with self.lock:
            return r.done_at

    def wait(self, r: Reservation) -> None:
        """Block until ``r`` completes (its time may move later while a demand load goes first)."""
        sleep_until(lambda: self.done_at(r))


def sleep_until(deadline: Callable[[], float] | float) -> None:
    """Block until ``time.perf_counter()`` reaches ``deadline`` (a time, or a function giving it, which may move):
    sleep until ``SPIN_S`` before it, then yield the CPU until it (on time to a few µs)."""
    at = deadline if callable(deadline) else (lambda: deadline)
    while True:
        remaining = at() - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > SPIN_S:
            time.sleep(remaining - SPIN_S)
        else:
            os.sched_yield()  # releases the GIL; time.sleep(0) would overshoot by the timer slack (~50 µs)


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
        self.pin_memory = pin_memory
        self._staging: list[torch.Tensor] = []  # free staging buffers (see staging())
        self._staging_lock = threading.Lock()
        self.model = BandwidthModel(profile) if profile.modelled else None
        self.fds = [os.open(f, os.O_RDONLY) for f in store.files]
        self.mirror: torch.Tensor | None = None
        self.mirror_views: list[list[memoryview]] | None = None
        self.cold_read_mode = ""
        self.direct_fds: list[int] = []
        if profile.reads_disk:
            self.cold_read_mode = self._open_direct()
        self.cold_each_read = self.cold_read_mode == "fadvise" and profile.cold_each_read
        if profile.kind == "ram":
            self.mirror = self._load_mirror(pin_memory)
            self.mirror_views = [[memoryview(self.mirror[l, e].numpy()).cast("B") for e in range(store.n_experts)]
                                 for l in range(store.n_layers)]

    @property
    def direct(self) -> bool:
        """Reads are ``O_DIRECT`` (DMA into the destination): they should land in a :meth:`staging` buffer."""
        return self.cold_read_mode == "direct"

    @contextmanager
    def staging(self) -> Iterator[torch.Tensor]:
        """A staging buffer of one record for the duration of one transfer: page-aligned (an ``O_DIRECT`` read can
        land in it), pinned when the reader pins memory (CUDA), and long-lived: the reader keeps a free list that
        every run using it shares (a buffer is made only when all are in use), so no run reads into memory of its
        own. A transfer reads into it, then copies it into the cache slot."""
        with self._staging_lock:
            buf = self._staging.pop() if self._staging else None
        if buf is None:
            buf = host_buffer(self.store.record_bytes, pin=self.pin_memory)
        try:
            yield buf
        finally:
            with self._staging_lock:
                self._staging.append(buf)

    def _open_direct(self) -> str:
        """'direct' when every store file opens with O_DIRECT and an aligned read succeeds, else 'fadvise'."""
        flag = getattr(os, "O_DIRECT", 0)
        fds: list[int] = []
        try:
            if not flag:
                raise OSError("O_DIRECT is not available on this platform")
            for f in self.store.files:
                fds.append(os.open(f, os.O_RDONLY | flag))
            probe = mmap.mmap(-1, self.store.record_bytes)  # page-aligned
            try:
                if os.preadv(fds[0], [probe], 0) != self.store.record_bytes:
                    raise OSError("short O_DIRECT read")
            finally:
                probe.close()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            log.warning("nvme_cold: O_DIRECT refused on %s (%s); falling back to page-cache eviction "
                        "(POSIX_FADV_DONTNEED) around every read", self.store.root, exc)
            for fd in self.fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return "fadvise"
        self.direct_fds = fds
        return "direct"

    def _load_mirror(self, pin: bool) -> torch.Tensor:
        rb = self.store.record_bytes
        t = host_buffer(self.store.n_layers * self.store.n_experts * rb, pin).view(self.store.n_layers,
                                                                                   self.store.n_experts, rb)
        for layer in range(self.store.n_layers):
            view = memoryview(t[layer].numpy()).cast("B")
            got = os.preadv(self.fds[layer], [view], 0)
            if got != rb * self.store.n_experts:
                raise StorageError(f"{self.store.files[layer]}: short read ({got} bytes) while mirroring into RAM")
        return t

    def close(self) -> None:
        for fd in [*self.fds, *self.direct_fds]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.direct_fds = [], []

    def __del__(self) -> None:  # pragma: no cover - best effort
        self.close()

    def prepare_run(self) -> None:
        """Start of a run: a profile that reads the disk evicts the store's pages (O_DIRECT reads bypass them
        anyway); the ``bandwidth``-emulated device becomes idle with the store in the page cache (so the device model,
        not a physical read, sets the time of every load)."""
        if self.profile.reads_disk:
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

    def load(self, layer: int, expert: int, dest: torch.Tensor, view: memoryview | None = None,
             charged: bool = True, demand: bool = False) -> None:
        """Bring the record into the host tensor ``dest`` (a cache slot) as a transfer does: a direct read through a
        :meth:`staging` buffer, then a copy; any other read (RAM mirror, page cache) straight into ``dest``. The
        arguments are :meth:`read`'s."""
        if not self.direct:
            self.read(layer, expert, dest, view, charged, demand)
            return
        with self.staging() as buf:
            self.read(layer, expert, buf, charged=charged, demand=demand)
            dest.copy_(buf)

    def read(self, layer: int, expert: int, dest: torch.Tensor, view: memoryview | None = None,
             charged: bool = True, demand: bool = False) -> None:
        """Fill ``dest`` (uint8 host tensor of record_bytes; ``view``: its bytes, if the caller has them) with
        the record; an emulated load blocks until its device completes it (unless not ``charged``: a prefill
        load, which is not measured); ``demand``: the executing layer waits for it (it goes first at the device)."""
        res = self.model.reserve(time.perf_counter(), demand=demand) if self.model is not None and charged else None
        if self.faults is not None:
            self.faults.check(layer, expert)
        rb = self.store.record_bytes
        if view is None:
            view = memoryview(dest.numpy()).cast("B")
        if self.mirror_views is not None:
            view[:] = self.mirror_views[layer][expert]
        else:
            off = expert * rb
            direct = bool(self.direct_fds) and dest.data_ptr() % self.store.layout.alignment == 0
            fd = self.direct_fds[layer] if direct else self.fds[layer]
            got = os.preadv(fd, [view], off)
            if got != rb:
                raise OSError(5, f"{self.store.files[layer]}: short read of expert {expert} ({got}/{rb} bytes)")
            if self.cold_each_read or (self.cold_read_mode == "direct" and not direct):
                os.posix_fadvise(self.fds[layer], off, rb, os.POSIX_FADV_DONTNEED)
        if self.verify:
            self.store.check_record(layer, expert, view)
        if res is not None:
            self.model.wait(res)
        elif charged and self.profile.delay_ms > 0:
            sleep_until(time.perf_counter() + self.profile.delay_ms * 1e-3)


HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A zeroed uint8 host tensor for expert bytes (cache slots, staging buffers, the RAM mirror), page-aligned (an
    O_DIRECT read can land in it); in pinned memory with ``pin`` (CUDA).

    Otherwise private anonymous memory on 2 MB boundaries, advised to transparent huge pages (used where the kernel
    allows ``madvise``; a no-op elsewhere) and touched at once (no page faults on the hot path). On the reference
    VM, streaming reads of expert records from 4 KB-page buffers were slower than from huge-page buffers and their
    speed differed by buffer and by process: with 4 KB pages a run's own cache memory set its expert compute speed,
    which pairing cannot remove."""
    if pin:
        base = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8).pin_memory()
        off = -base.data_ptr() % mmap.PAGESIZE
        return base[off: off + nbytes].zero_()
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernels without THP
            pass
    base = torch.frombuffer(m, dtype=torch.uint8)
    off = -base.data_ptr() % HUGE_PAGE
    return base[off: off + nbytes].zero_()


def measure_transfer_ms(reader: ExpertReader, n: int = 64, seed: int = 0) -> list[float]:
    """Isolated (one at a time) load times of ``n`` random experts under the reader's profile, in ms: as a transfer
    makes them (a direct read lands in a staging buffer and is copied on into a slot)."""
    rng = random.Random(seed)
    slot = host_buffer(reader.store.record_bytes)
    reader.prepare_run()
    out = []
    for _ in range(n):
        layer, expert = rng.randrange(reader.store.n_layers), rng.randrange(reader.store.n_experts)
        if reader.profile.reads_disk:
            os.posix_fadvise(reader.fds[layer], reader.store.offset(expert), reader.store.record_bytes,
                             os.POSIX_FADV_DONTNEED)
        if reader.model is not None:
            reader.model.reset()
        t0 = time.perf_counter()
        reader.load(layer, expert, slot, demand=True)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def physical_read_ms(store: ExpertStore, settings: dict[str, Any], n: int | None = None) -> float:
    """The median isolated cold read of one record from this host's disk (``nvme_cold``, ``n`` random experts; the
    window profile's ``transfer_samples`` by default): what the ``delay`` emulation's delays add to."""
    reader = ExpertReader(store, make_profile("nvme_cold", settings))
    try:
        ms = measure_transfer_ms(reader, n=int(n or settings["window"]["transfer_samples"]))
    finally:
        reader.close()
    return statistics.median(ms)
