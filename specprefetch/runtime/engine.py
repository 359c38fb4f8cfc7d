"""The offloaded MoE runtime: routed experts served from a bounded cache, with window-aware prefetching.

:class:`OffloadedRuntime` replaces each MoE block's fused ``experts`` module by an :class:`OffloadedExperts`
with the same call signature ``(hidden_states, top_k_index, top_k_weights)``. The gate is never touched: the
native router still decides which experts run, so the model's outputs cannot depend on the prefetch policy.

At MoE layer ``l`` (one call of ``OffloadedExperts.forward``):

1. ``t_exec``: the layer's demand T^l is known. Queued prefetches for ``l`` that are not needed are cancelled,
   needed ones are promoted to demand loads; the cache's content A^l(t_exec) is recorded (ReadyRecall, hits);
   prefetched experts the layer does not need become the first eviction candidates.
2. Required experts are pinned; absent ones are queued as demand loads, which the compute thread performs itself
   when it reaches them (no hand-off to an I/O thread; the layer blocks either way).
3. In a decoding step (one token), the policy's provider turns ``x^l`` into priorities ``s^{l+1}`` (``t_pred``); the
   top ``M_max`` experts of layer ``l+1`` neither resident nor in flight are queued as asynchronous prefetches in
   priority order (PRED0 computes them but issues nothing). A prefill (many tokens) loads on demand only: the
   prompt's prefill leaves every policy the same cache, and decoding is what the policies are measured on.
4. The experts are computed in ascending expert id (the accumulation order of transformers' eager loop, so the
   result is bit-identical whatever was cached), waiting for the loads still in flight (the stall). The layer's
   experts then become the most recently used (in ascending id, whatever order they arrived in).

``compute_opt`` (Figure 6's "compute optimization"): for a decoding step (one token) the layer's experts are
gathered from the cache slots with one ``index_select`` per weight matrix and computed with two batched matmuls,
instead of transformers' Python loop issuing ~10 kernels per expert. Prefill (many tokens) always uses the loop.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.contracts import POLICIES, POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.budget import layer_budget
from specprefetch.runtime.cache import ExpertCache, Key, SlotPool
from specprefetch.runtime.layer import acquire, begin_layer, issue_prefetches
from specprefetch.runtime.priority import PriorityProvider
from specprefetch.runtime.storage import ExpertReader, StorageError
from specprefetch.runtime.store import ExpertStore, MoEBlock, find_moe_blocks
from specprefetch.runtime.timeline import LayerEvent, RunStats, summarize
from specprefetch.runtime.transfer import Transfer, TransferEngine

log = logging.getLogger(__name__)



class OffloadError(SpecPrefetchError):
    """The runtime cannot be set up as asked (capacity, policy, store/model mismatch)."""


@dataclass
class RuntimeOptions:
    """How the runtime serves experts. ``capacity`` is in experts (0: every routed expert fits)."""

    policy: str = "off"
    m_max: int = 0
    capacity: int = 0
    compute_opt: bool = True
    io_workers: int = 4
    io_retries: int = 2
    sync_prefetch: bool = False   # wait for every transfer at the end of each layer (deterministic; tests/sim)
    record_routing: bool = False  # keep each event's top-k and priorities (simulator input)
    preload: bool = False         # every expert resident before the run (implied by policy "resident")
    topm_absent: tuple[int, ...] = ()  # record |Top_M(s) minus available| at t_pred for these M (Figure 1b)
    layer_m_max: tuple[int, ...] = ()  # per-layer budget M_max,l (index: the layer prefetched into); (): m_max

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OffloadError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.m_max < 0 or any(m < 0 for m in self.layer_m_max):
            raise OffloadError(f"m_max must be >= 0, got {self.m_max} {list(self.layer_m_max) or ''}")

    def budget_of(self, layer: int) -> int:
        """M_max of the prefetches into ``layer``: its per-layer budget when one is given, else ``m_max``."""
        return layer_budget(self.m_max, self.layer_m_max, layer)


def top_k_index_row(idx: Tensor, device: torch.device) -> Tensor:
    """The single token's expert ids on ``device`` (idx is the host copy of top_k_index)."""
    row = idx[0]
    return row if row.device == device else row.to(device)


class OffloadedExperts(nn.Module):
    """Drop-in replacement of a fused experts module; computes through the bound runtime's expert cache.

    It holds no weights. A harness may install these modules once (e.g. before moving the model to CUDA, so the
    fused experts never reach the GPU) and bind a new runtime to them for every run.
    """

    is_offloaded = True

    def __init__(self, runtime: OffloadedRuntime | None, ordinal: int, act_fn: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.ordinal = ordinal
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.bind(runtime)

    def bind(self, runtime: OffloadedRuntime | None) -> None:
        object.__setattr__(self, "_runtime", runtime)  # not a submodule: no parameters, no state_dict entry

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self._runtime is None:
            raise OffloadError(f"MoE layer ordinal {self.ordinal}: offloaded experts used with no runtime bound")
        return self._runtime.moe_forward(self, hidden_states, top_k_index, top_k_weights)


def install_offloaded(blocks: list[MoEBlock]) -> list[nn.Module]:
    """Replace every block's experts by an unbound :class:`OffloadedExperts`; returns the originals."""
    originals = []
    for b in blocks:
        originals.append(b.experts)
        if not getattr(b.experts, "is_offloaded", False):
            b.block.experts = OffloadedExperts(None, b.ordinal, b.experts.act_fn, int(b.experts.num_experts))
            b.experts = b.block.experts
    return originals


def resident_keys(store: ExpertStore) -> list[Key]:
    """Every expert of ``store``, layer by layer: the order in which an all-resident cache is preloaded, so the
    ``i``-th key is in slot ``i`` (:meth:`ExpertCache.preload`) and :func:`fill_resident` puts its bytes there."""
    return [(l, e) for l in range(store.n_layers) for e in range(store.n_experts)]


def fill_resident(pool: SlotPool, store: ExpertStore) -> SlotPool:
    """Every expert record of ``store`` into ``pool``, the ``i``-th of :func:`resident_keys` in slot ``i``; one read
    per layer file."""
    slot = {key: i for i, key in enumerate(resident_keys(store))}
    for l in range(store.n_layers):
        for e, rec in enumerate(store.layer_records(l)):
            pool.record(slot[(l, e)]).copy_(rec)
    return pool


def resident_pool(store: ExpertStore, device: str | torch.device = "cpu") -> SlotPool:
    """A pool holding every expert of ``store`` (:func:`fill_resident`), read once and shared by all-resident
    runtimes (``resident=``): they never evict or write a slot, so one copy serves every run."""
    return fill_resident(SlotPool(store.total_experts, store.layout, torch.device(device)), store)


class OffloadedRuntime:
    """Batch-1 offloaded decoding of a transformers MoE model (see the module docstring)."""

    def __init__(self, model: nn.Module, store: ExpertStore, reader: ExpertReader, options: RuntimeOptions,
                 provider: PriorityProvider | None = None, spec: Any | None = None,
                 device: str | torch.device = "cpu", resident: SlotPool | None = None) -> None:
        from specprefetch.models.routing import discover_routing

        self.model = model
        self.store = store
        self.reader = reader
        self.opt = options
        self.spec = spec if spec is not None else discover_routing(model)
        self.blocks: list[MoEBlock] = find_moe_blocks(model, self.spec)
        store.check_model(self.blocks)
        self.n_layers = len(self.blocks)
        self.n_experts = store.n_experts
        self.top_k = int(self.spec.top_k)
        self.device = torch.device(device)
        if store.layout.quant == "int4":
            from specprefetch.runtime.quant import check_int4_available

            check_int4_available(self.device)  # the packed 4-bit layout is aten's CPU one
        self.policy = POLICY[options.policy]
        self.preload = options.preload or self.policy.preload
        cap = store.total_experts if self.preload or not options.capacity else options.capacity
        cap = min(int(cap), store.total_experts)
        if cap < self.top_k:
            raise OffloadError(f"cache capacity {cap} experts < top_k={self.top_k}: one layer cannot execute")
        if self.policy.provider is not None and provider is None:
            raise OffloadError(f"policy {options.policy!r} needs a priority provider (a predictor)")
        self.provider = provider if self.policy.predicts else None
        self.cache = ExpertCache(cap)
        # every expert resident: a shared pool already holding every record (:func:`resident_pool`) spares the read
        self.shared_pool = self.preload and resident is not None
        if self.shared_pool and (resident.capacity != cap or resident.layout != store.layout):
            raise OffloadError("the shared all-resident pool is not this store's (capacity or record layout differ)")
        self.pool = resident if self.shared_pool else SlotPool(cap, store.layout, self.device)
        self.layout = store.layout
        self.engine = TransferEngine(reader, self.cache, self.pool, options.io_workers, options.io_retries)
        self.originals: list[nn.Module | None] = []
        self.installed = False
        self.events: list[LayerEvent] = []
        self.step = -1
        self._issued: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        self._routing: dict[int, tuple[Tensor, Tensor]] = {}  # the latest step's routing per layer (adopt)

    # -------------------------------------------------------------- lifecycle
    def install(self) -> OffloadedRuntime:
        """Swap every MoE block's experts module for an offloaded one (the gates stay as they are)."""
        if self.installed:
            return self
        for b in self.blocks:
            if getattr(b.experts, "is_offloaded", False):
                self.originals.append(None)  # installed by a harness: bind only
            else:
                self.originals.append(b.experts)
                b.block.experts = OffloadedExperts(None, b.ordinal, b.experts.act_fn, self.n_experts)
                b.experts = b.block.experts
            b.experts.bind(self)
        self.installed = True
        return self

    def activate(self) -> None:
        """Bind the installed experts modules to this runtime again (another runtime may have used the model)."""
        for b in self.blocks:
            b.experts.bind(self)

    def uninstall(self) -> None:
        """Unbind; experts modules this runtime replaced get their originals back (the plain model again)."""
        for b, orig in zip(self.blocks, self.originals):
            b.experts.bind(None)
            if orig is not None:
                b.block.experts = orig
                b.experts = orig
        self.originals = []
        self.installed = False

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> OffloadedRuntime:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
        self.close()

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def capacity_bytes(self) -> int:
        return self.cache.capacity * self.store.record_bytes

    def reset_run(self) -> None:
        """A fresh run: empty cache (or every expert resident), storage prepared (cold), no history."""
        self.engine.drain()
        self.cache.reset()
        self.engine.reset_log()
        self.events = []
        self.step = -1
        self._issued.clear()
        self._routing.clear()
        if self.preload:
            self._preload_all()
        self.reader.prepare_run()
        self.new_sequence()

    def new_sequence(self) -> None:
        """A new prompt starts: per-sequence predictor state is dropped (the cache is kept)."""
        if self.provider is not None:
            self.provider.reset()

    def adopt(self, src: OffloadedRuntime) -> None:
        """Continue from ``src``'s state after a prefill, as if this runtime had run it: its cache content and LRU
        order with the bytes of its slots (unless every expert is resident here), its events and step, and the
        prefill's routing observed by this runtime's provider. Both runtimes are idle (transfers drained)."""
        src.engine.drain()
        self.engine.drain()
        if not self.preload:
            if src.preload or src.capacity != self.capacity or src.layout != self.layout:
                raise OffloadError("a runtime can only adopt the state of a runtime with the same cache capacity "
                                   "and record layout, not one with every expert resident")
            self.cache.copy_from(src.cache)
            self.pool.copy_from(src.pool, self.cache.resident.values())
        self.events = copy.deepcopy(src.events)
        self.step = src.step
        self._routing = dict(src._routing)
        if self.provider is not None:
            self.provider.reset()
            for l, (idx, w) in sorted(self._routing.items()):
                self.provider.observe(l, idx, w)

    def _preload_all(self) -> None:
        self.cache.preload(resident_keys(self.store))
        if not self.shared_pool:
            fill_resident(self.pool, self.store)

    def stats(self, decode_only: bool = True) -> RunStats:
        st = summarize(self.events, self.top_k, decode_only)
        st.io_errors = self.engine.io_errors
        st.peak_cache_experts = self.cache.peak_used
        return st

    # -------------------------------------------------------------- the MoE layer
    def moe_forward(self, mod: OffloadedExperts, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        l = mod.ordinal
        t_exec = time.perf_counter()
        if l == 0:
            self.step += 1
        idx = top_k_index.detach().to("cpu")
        self.engine.charge_delays = idx.shape[0] == 1  # prefill loads take no emulated delay (prefill is not timed)
        required = sorted({e for e in idx.reshape(-1).tolist() if 0 <= e < self.n_experts})
        keys: list[Key] = [(l, e) for e in required]
        ev = self._begin_layer(l, t_exec, idx, required)
        protect = set(keys)
        j = self._acquire(keys, 0, protect)
        if idx.shape[0] == 1:
            self._predict_and_prefetch(l, hidden, ev, protect)
        if self.opt.compute_opt and hidden.shape[0] == 1 and len(keys) == idx.shape[1]:
            out = self._compute_batched(mod, hidden, idx, top_k_weights, keys, j, protect, ev)
        else:
            out = self._compute_loop(mod, hidden, idx, top_k_weights, keys, j, protect, ev)
        if self.opt.sync_prefetch:
            self.engine.drain()
        with self.cache.lock:  # LRU: the layer used its experts (in ascending id, whatever order they arrived in)
            for key in keys:
                self.cache.touch(key)
        self._routing[l] = (idx, top_k_weights.detach())
        if self.provider is not None:
            self.provider.observe(l, *self._routing[l])
        ev.t_done = time.perf_counter()
        return out

    def _begin_layer(self, l: int, t_exec: float, idx: Tensor, required: list[int]) -> LayerEvent:
        ev = begin_layer(self.cache, self.engine, self._issued, self.step, l, t_exec, idx.tolist(), required)
        if self.opt.record_routing:
            ev.topk = idx.clone()
        self.events.append(ev)
        return ev

    def _acquire(self, keys: list[Key], j: int, protect: set[Key]) -> int:
        return acquire(self.cache, self.engine, keys, j, protect, self.step, 0.0)

    def _wait_for_room(self) -> None:
        if not self.engine.wait_any():
            raise OffloadError(f"expert cache of {self.cache.capacity} experts cannot hold one more expert "
                                "(every slot pinned)")

    def _ensure(self, key: Key, protect: set[Key]) -> int:
        """Block until ``key`` is resident (it is pinned); reload on demand if its transfer failed."""
        failures = 0
        while True:
            with self.cache.lock:
                if self.cache.is_resident(key):
                    return self.cache.slot(key)
                tr = self.engine.inflight(key)
                if tr is None:  # its transfer failed (slot and pin released): load it again, on demand
                    failures += 1
                    if failures > self.opt.io_retries + 1:
                        raise StorageError(f"expert {key[1]} of MoE layer {key[0]} could not be read from "
                                           f"{self.store.files[key[0]]} (I/O errors on every attempt)")
                    if self.cache.reserve(key, protect, last_resort=True) is None:
                        tr = None
                    else:
                        self.cache.pin(key)
                        tr = self.engine.submit(key, "demand", self.step)
            if tr is None:
                self._wait_for_room()
            elif self.engine.steal(key) is tr:
                self.engine.execute(tr)  # not started by any worker: load it on this thread
            else:
                self.engine.wait(tr)

    def _predict_and_prefetch(self, l: int, hidden: Tensor, ev: LayerEvent, protect: set[Key]) -> None:
        if self.provider is None or l + 1 >= self.n_layers:
            return
        s = self.provider.scores(l, hidden)
        ev.t_pred = time.perf_counter()
        if s is None:
            return
        if self.opt.record_routing:
            ev.scores = torch.as_tensor(s).clone()
        issue_prefetches(self.cache, self.engine, self._issued, ev, self.step, l, s, self.opt.budget_of(l + 1),
                         self.provider.empty_when_zero, self.policy.issues, protect, ev.t_pred, self.opt.topm_absent)

    def _release(self, key: Key, slot: int, protect: set[Key]) -> None:
        self.pool.mark_used(slot)
        self.cache.unpin(key)
        protect.discard(key)

    def _compute_loop(self, mod: OffloadedExperts, hidden: Tensor, idx: Tensor, weights: Tensor,
                      keys: list[Key], j: int, protect: set[Key], ev: LayerEvent) -> Tensor:
        """transformers' eager expert loop over cached weights (same op order: bit-identical results)."""
        out = torch.zeros_like(hidden)
        idx_dev = idx.to(hidden.device)
        stall = 0.0
        ev.t_compute = ev.t_ready = time.perf_counter()
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            waited = j <= i or not self.cache.is_resident(key)
            while j <= i:
                self._wait_for_room()
                j = self._acquire(keys, j, protect)
            slot = self._ensure(key, protect)
            t1 = time.perf_counter()
            if waited:
                ev.t_ready = t1
            stall += t1 - t0
            pos, tok = torch.where(idx_dev.t() == key[1])
            y = self.layout.mlp(self.pool.weights(slot), hidden[tok], mod.act_fn) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
            with self.cache.lock:
                self._release(key, slot, protect)
                j = self._acquire(keys, j, protect)
        ev.stall_s = stall
        return out

    def _compute_batched(self, mod: OffloadedExperts, hidden: Tensor, idx: Tensor, weights: Tensor,
                         keys: list[Key], j: int, protect: set[Key], ev: LayerEvent) -> Tensor:
        """One decoding token: gather the K experts' weights, two batched matmuls, fixed-order sum."""
        t0 = ev.t_compute = time.perf_counter()
        while j < len(keys):
            self._wait_for_room()
            j = self._acquire(keys, j, protect)
        slots = [self._ensure(k, protect) for k in keys]
        ev.t_ready = time.perf_counter()
        ev.stall_s = ev.t_ready - t0
        # one token: its top-k ids are distinct, so sorting them gives ``keys``' order
        w = weights[0, torch.argsort(top_k_index_row(idx, weights.device))]
        if self.pool.gate_up is None:  # quantized or widened experts: one MLP each, summed in ascending id
            out = torch.zeros_like(hidden)
            for s, wk in zip(slots, w.unbind(0)):
                out.add_(self.layout.mlp(self.pool.weights(s), hidden, mod.act_fn) * wk)
            with self.cache.lock:
                for k, s in zip(keys, slots):
                    self._release(k, s, protect)
            return out
        st = torch.tensor(slots, device=self.pool.device)
        gu = self.pool.gate_up.index_select(0, st)            # [E, 2I, H]
        dn = self.pool.down.index_select(0, st)                # [E, H, I]
        with self.cache.lock:
            for k, s in zip(keys, slots):
                self._release(k, s, protect)
        x = hidden[0]
        gate, up = torch.matmul(gu, x).chunk(2, dim=-1)         # [E, I] each
        h = mod.act_fn(gate) * up
        y = torch.bmm(dn, h.unsqueeze(-1)).squeeze(-1)          # [E, H]
        return (y * w[:, None]).sum(dim=0, keepdim=True).to(hidden.dtype)
