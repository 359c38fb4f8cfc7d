"""The bounded expert cache ("accelerator memory"): slots, LRU eviction, pins and in-flight reservations.

This class is pure bookkeeping (which expert occupies which slot), shared verbatim by the runtime and the
trace-driven simulator so both make the same eviction decisions. The runtime pairs it with a
:class:`SlotPool` holding the actual bytes (host RAM on CPU, GPU memory on CUDA).

Invariants (checked by the tests): ``resident + in flight <= capacity`` at all times; a pinned expert (needed by
the layer executing now) or an in-flight one (a transfer is writing its slot) is never evicted.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Collection, Iterable

import torch

from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.storage import HUGE_PAGE, host_buffer
from specprefetch.runtime.core.store import RecordLayout

Key = tuple[int, int]  # (MoE layer ordinal, expert id)


class CacheError(SpecPrefetchError):
    """Cache misuse or a capacity that cannot serve one layer."""


class ExpertCache:
    """LRU cache of ``capacity`` expert slots (thread-safe: every method takes ``self.lock``)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise CacheError(f"expert cache capacity must be >= 1 expert, got {capacity}")
        self.capacity = int(capacity)
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.resident: OrderedDict[Key, int] = OrderedDict()  # oldest first
            self.inflight: dict[Key, int] = {}
            self.pins: Counter[Key] = Counter()
            self.free: list[int] = list(range(self.capacity - 1, -1, -1))
            self.res_by_layer: defaultdict[int, set[int]] = defaultdict(set)
            self.infl_by_layer: defaultdict[int, set[int]] = defaultdict(set)
            self.peak_used = 0
            self.evictions = 0

    # -------------------------------------------------------------- queries
    @property
    def used(self) -> int:
        return len(self.resident) + len(self.inflight)

    def is_resident(self, key: Key) -> bool:
        return key in self.resident

    def is_inflight(self, key: Key) -> bool:
        return key in self.inflight

    def slot(self, key: Key) -> int:
        with self.lock:
            if key in self.resident:
                return self.resident[key]
            if key in self.inflight:
                return self.inflight[key]
        raise CacheError(f"expert {key} is not in the cache")

    def unavailable_mask_of_layer(self, layer: int) -> set[int]:
        """Experts of ``layer`` resident or in flight (A ∪ U of the paper's selection rule)."""
        with self.lock:
            return self.res_by_layer[layer] | self.infl_by_layer[layer]

    # -------------------------------------------------------------- updates
    def touch(self, key: Key) -> None:
        with self.lock:
            if key in self.resident:
                self.resident.move_to_end(key)

    def demote(self, key: Key) -> None:
        """Make a resident expert the first eviction candidate (a prefetch its target layer did not use)."""
        with self.lock:
            if key in self.resident:
                self.resident.move_to_end(key, last=False)

    def pin(self, key: Key) -> None:
        with self.lock:
            if key not in self.resident and key not in self.inflight:
                raise CacheError(f"cannot pin expert {key}: neither resident nor in flight")
            self.pins[key] += 1

    def unpin(self, key: Key) -> None:
        with self.lock:
            if self.pins[key] <= 0:
                raise CacheError(f"unpin of expert {key} that is not pinned")
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]

    def _victim(self, protect: Collection[Key], last_resort: bool) -> Key | None:
        fallback = None
        for k in self.resident:  # oldest first
            if self.pins.get(k):
                continue
            if k in protect:
                if last_resort and fallback is None:
                    fallback = k
                continue
            return k
        return fallback

    def reserve(self, key: Key, protect: Collection[Key] = (), evict: bool = True,
                last_resort: bool = True) -> int | None:
        """A slot for an expert about to be transferred (it becomes in flight), or None if none can be freed.

        Evicts the least recently used resident expert that is neither pinned nor in ``protect`` (experts the
        current layer still needs); a protected one only if ``last_resort`` (a demand load that must proceed;
        a prefetch never evicts what the executing layer needs).
        """
        with self.lock:
            if key in self.resident or key in self.inflight:
                raise CacheError(f"expert {key} is already resident or in flight")
            if not self.free:
                victim = self._victim(protect, last_resort) if evict else None
                if victim is None:
                    return None
                self.free.append(self.resident.pop(victim))
                self.res_by_layer[victim[0]].discard(victim[1])
                self.evictions += 1
            slot = self.free.pop()
            self.inflight[key] = slot
            self.infl_by_layer[key[0]].add(key[1])
            self.peak_used = max(self.peak_used, self.used)
            return slot

    def fill(self, key: Key) -> None:
        """The transfer of ``key`` completed: it becomes resident (most recently used)."""
        with self.lock:
            if key not in self.inflight:
                raise CacheError(f"fill of expert {key} that is not in flight")
            self.resident[key] = self.inflight.pop(key)
            self.infl_by_layer[key[0]].discard(key[1])
            self.res_by_layer[key[0]].add(key[1])

    def cancel(self, key: Key) -> None:
        """The transfer of ``key`` failed or was cancelled: free its slot and drop its pins."""
        with self.lock:
            slot = self.inflight.pop(key, None)
            if slot is None:
                raise CacheError(f"cancel of expert {key} that is not in flight")
            self.free.append(slot)
            self.infl_by_layer[key[0]].discard(key[1])
            self.pins.pop(key, None)

    def copy_from(self, src: ExpertCache) -> None:
        """Take ``src``'s content: resident experts, their slots and LRU order (nothing may be in flight or pinned)."""
        with self.lock, src.lock:
            if src.capacity != self.capacity or src.inflight or src.pins:
                raise CacheError("a cache can only copy an idle cache of the same capacity")
            self.reset()
            self.resident = OrderedDict(src.resident)
            self.free = list(src.free)
            for l, ids in src.res_by_layer.items():
                self.res_by_layer[l] = set(ids)
            self.peak_used, self.evictions = src.peak_used, src.evictions

    def preload(self, keys: Iterable[Key]) -> None:
        """Mark experts resident without a transfer (the all-resident upper bound fills the pool itself); into an
        empty cache the ``i``-th key goes to slot ``i``."""
        with self.lock:
            for key in keys:
                slot = self.reserve(key, evict=False)
                if slot is None:
                    raise CacheError(f"preload of {key} exceeds the capacity of {self.capacity} experts")
                self.fill(key)


class SlotPool:
    """The bytes behind the cache slots: one ``[capacity, record_bytes]`` uint8 tensor on the accelerator.

    On CUDA each slot also has an event recorded on the compute stream when the layer using it finished issuing
    its kernels; a transfer into a reused slot waits for that event, so an asynchronous copy never overwrites
    weights a queued kernel still reads.
    """

    def __init__(self, capacity: int, layout: RecordLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capacity = capacity
        rb = layout.record_bytes
        if self.device.type == "cpu":  # huge pages, every slot on an alignment boundary (storage.host_buffer)
            if HUGE_PAGE % layout.alignment:
                raise CacheError(f"record alignment {layout.alignment} does not divide a 2 MB page")
            self.data = host_buffer(capacity * rb).view(capacity, rb)
        else:
            self.data = torch.zeros(capacity, rb, dtype=torch.uint8, device=self.device)
        self.events: list[torch.cuda.Event | None] = [None] * capacity
        if any(p.offset % torch.empty((), dtype=p.dtype).element_size() for p in layout.parts):
            raise CacheError("record layout is not aligned to the weight dtype")
        # per-slot views made once (a view per access costs more than the bookkeeping of a transfer)
        self._records = list(self.data.unbind(0))
        self._weights = [layout.views(r) for r in self._records]
        # dense unpadded experts: [C, 2I, H] / [C, H, I] views of every slot, for the batched one-token path
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        if layout.quant == "none" and not layout.padded:
            gu, dn = layout.parts
            self.gate_up = self.data[:, gu.offset: gu.offset + gu.nbytes].view(layout.dtype).view(capacity, *gu.shape)
            self.down = self.data[:, dn.offset: dn.offset + dn.nbytes].view(layout.dtype).view(capacity, *dn.shape)
        self._buffers = [memoryview(r.numpy()).cast("B") for r in self._records] if self.device.type == "cpu" else None

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def record(self, slot: int) -> torch.Tensor:
        return self._records[slot]

    def buffer(self, slot: int) -> memoryview | None:
        """The slot's bytes as a writable memoryview (CPU pool), for reads straight into it."""
        return None if self._buffers is None else self._buffers[slot]

    def weights(self, slot: int) -> tuple[torch.Tensor, ...]:
        return self._weights[slot]

    def copy_from(self, src: SlotPool, slots: Iterable[int]) -> None:
        """Copy the bytes of ``slots`` from ``src`` (a pool of the same layout)."""
        for s in slots:
            self._records[s].copy_(src.record(s))

    def mark_used(self, slot: int) -> None:
        """Record on the current CUDA stream that kernels reading ``slot`` have been issued."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.events[slot] = ev
