"""The offloaded MoE runtime: routed experts served from a bounded cache, with window-aware prefetching.

:class:`OffloadedRuntime` replaces each MoE block's fused ``experts`` module by an :class:`OffloadedExperts`
with the same call signature ``(hidden_states, top_k_index, top_k_weights)``. The gate is never touched: the
native router still decides which experts run, so the model's outputs cannot depend on the prefetch policy.

At MoE layer ``l`` (one call of ``OffloadedExperts.forward``), the per-layer loop of
:class:`~specprefetch.runtime.core.layer.LayerLoop` (the simulator runs the same one) over the
:class:`~specprefetch.runtime.core.transfer.TransferEngine`, with this module's matmuls as its compute:

1. ``t_exec``: the layer's demand T^l is known. Queued prefetches for ``l`` that are not needed are cancelled,
   needed ones are promoted to demand loads; the cache's content A^l(t_exec) is recorded (ReadyRecall, hits);
   prefetched experts the layer does not need become the first eviction candidates.
2. Required experts are pinned; absent ones are queued as demand loads, which the compute thread performs itself
   when it reaches them (no hand-off to an I/O thread; the layer blocks either way).
3. In a decoding step (one new token per sequence; ``batch`` sequences, beyond the paper's batch-1 runtime, give the
   paper's batch priorities: the per-token distributions summed), the policy's provider turns ``x^l`` into
   priorities ``s^{l+1}`` (``t_pred``); the
   top ``M_max`` experts of layer ``l+1`` neither resident nor in flight are queued as asynchronous prefetches in
   priority order (PRED0 computes them but issues nothing). With a look-ahead ``d`` (``lookahead``, beyond the
   paper) the provider predicts layer ``l+d`` and the prefetches go there, at that layer's budget. A prefill (many
   tokens) loads on demand only: the prompt's prefill leaves every policy the same cache, and decoding is what the
   policies are measured on.
4. The experts are computed in ascending expert id (the accumulation order of transformers' eager loop, so the
   result is bit-identical whatever was cached), waiting for the loads still in flight (the stall). The layer's
   experts then become the most recently used (in ascending id, whatever order they arrived in).

``compute_opt`` (Figure 6's "compute optimization"): for a decoding step (one token) the layer's experts are
gathered from the cache slots with one ``index_select`` per weight matrix and computed with two batched matmuls,
instead of transformers' Python loop issuing ~10 kernels per expert. Prefill (many tokens) always uses the loop.

A pre-attention provider (``stage`` "pre_attention", beyond the paper) is not asked in step 3: a forward hook on
each MoE layer's pre-attention norm (``RoutingSpec.pre_norms``) hands it that layer's normalised input in a decoding
step, before the attention runs, and its prefetches for that layer go out then (:meth:`LayerLoop.pre_attention`):
the window is the layer's attention. The hooks only read the norm's output, so the model's outputs are unchanged.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.contracts import POLICIES, POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.budget import EwmaBudget, layer_budget, online_budget
from specprefetch.runtime.core.cache import ExpertCache, Key, SlotPool
from specprefetch.runtime.core.layer import LayerLoop
from specprefetch.runtime.core.priority import PriorityProvider
from specprefetch.runtime.core.storage import ExpertReader, StorageError
from specprefetch.runtime.core.store import ExpertStore, MoEBlock, find_moe_blocks
from specprefetch.runtime.core.timeline import LayerEvent, RunStats, summarize
from specprefetch.runtime.core.transfer import TransferEngine

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
    lookahead: int = 1            # layer l prefetches into layer l + lookahead (its provider must predict that far)
    ewma: EwmaBudget | None = None  # the online budget rule (its seeds): overrides m_max / layer_m_max when given
    batch: int = 1                # sequences decoded together (a decoding step: one new token of each)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OffloadError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise OffloadError(f"lookahead must be an integer >= 1, got {self.lookahead!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise OffloadError(f"batch must be an integer >= 1, got {self.batch!r}")
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
    """Offloaded greedy decoding of a transformers MoE model, one sequence or a batch (``RuntimeOptions.batch``;
    see the module docstring)."""

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
            from specprefetch.runtime.core.quant import check_int4_available

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
        if self.provider is not None:
            self.provider.batch = options.batch  # its per-sequence state (Naive Prefetch) reads the batch
        ahead = getattr(self.provider, "lookahead", options.lookahead)
        if ahead != options.lookahead:
            raise OffloadError(f"policy {options.policy!r} prefetches {options.lookahead} layer(s) ahead, but its "
                               f"{self.provider.name} provider predicts {ahead} layer(s) ahead")
        if options.lookahead >= max(self.n_layers, 2):
            raise OffloadError(f"lookahead {options.lookahead} >= the model's {self.n_layers} MoE layers")
        self.cache = ExpertCache(cap)
        # every expert resident: a shared pool already holding every record (:func:`resident_pool`) spares the read
        self.shared_pool = self.preload and resident is not None
        if self.shared_pool and (resident.capacity != cap or resident.layout != store.layout):
            raise OffloadError("the shared all-resident pool is not this store's (capacity or record layout differ)")
        self.pool = resident if self.shared_pool else SlotPool(cap, store.layout, self.device)
        self.layout = store.layout
        self.engine = TransferEngine(reader, self.cache, self.pool, options.io_workers, options.io_retries)
        self.loop = LayerLoop(self.cache, self.engine, self.provider, self.policy.issues, self.n_layers,
                              self.n_experts, options.budget_of, compute_opt=options.compute_opt,
                              sync=options.sync_prefetch,
                              retries=options.io_retries, record=options.record_routing,
                              topm_absent=tuple(options.topm_absent), load_error=self._load_error,
                              online=online_budget(options.policy, options.ewma), batch=options.batch)
        self.originals: list[nn.Module | None] = []
        self._pre_hooks: list[Any] = []  # a pre-attention provider's hooks on the pre-attention norms
        self.installed = False
        self.step = -1
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
        if self.loop.early:
            if len(self.spec.pre_norms) != self.n_layers:
                raise OffloadError(f"policy {self.opt.policy!r} predicts from the pre-attention input, but the "
                                   f"{self.spec.arch} routing spec names no pre-attention norm per MoE layer")
            self._pre_hooks = [norm.register_forward_hook(self._pre_attention_hook(l))
                               for l, norm in enumerate(self.spec.pre_norms) if l >= 1]
        self.installed = True
        return self

    def activate(self) -> None:
        """Bind the installed experts modules to this runtime again (another runtime may have used the model)."""
        for b in self.blocks:
            b.experts.bind(self)

    def uninstall(self) -> None:
        """Unbind; experts modules this runtime replaced get their originals back (the plain model again)."""
        for h in self._pre_hooks:
            h.remove()
        self._pre_hooks = []
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
    def events(self) -> list[LayerEvent]:
        """One :class:`LayerEvent` per MoE layer call of this run (the loop's)."""
        return self.loop.events

    @events.setter
    def events(self, events: list[LayerEvent]) -> None:
        self.loop.events = events

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
        self.loop.issued.clear()
        self.loop.online = online_budget(self.opt.policy, self.opt.ewma)
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
        """One call of MoE layer ``mod.ordinal``: the shared per-layer loop, computing with :class:`_LayerCompute`."""
        l = mod.ordinal
        t_exec = time.perf_counter()
        if l == 0:
            self.step += 1
        idx = top_k_index.detach().to("cpu")
        work = _LayerCompute(self, mod, hidden, idx, top_k_weights)
        self.loop.run(self.step, l, idx.tolist(), work, t_exec, idx.clone() if self.opt.record_routing else None)
        return work.out

    def _pre_attention_hook(self, layer: int) -> Callable[..., None]:
        """The forward hook on MoE layer ``layer``'s pre-attention norm: in a decoding step (one new token per
        sequence), the provider's prediction for ``layer`` from the norm's output, before the attention runs."""
        batch = self.opt.batch

        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            if self._runtime_of_hook_is_bound() and output.shape[:-1].numel() == batch:
                self.loop.pre_attention(self.step, layer, _PreAttentionScores(output.detach().reshape(batch, -1)))

        return hook

    def _runtime_of_hook_is_bound(self) -> bool:
        """This runtime serves the model now (a harness may bind another one to the same modules)."""
        return self.installed and bool(self.blocks) and getattr(self.blocks[0].experts, "_runtime", None) is self

    def _load_error(self, key: Key) -> StorageError:
        return StorageError(f"expert {key[1]} of MoE layer {key[0]} could not be read from "
                            f"{self.store.files[key[0]]} (I/O errors on every attempt)")


class _PreAttentionScores:
    """The runtime's work of a pre-attention prediction (a :class:`~specprefetch.runtime.core.layer.LayerWork` for
    :meth:`LayerLoop.pre_attention`): the provider's priorities from the layer's pre-attention input."""

    __slots__ = ("x",)

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def scores(self, provider: PriorityProvider, layer: int) -> Any:
        return provider.scores(layer, self.x)

    def issued(self, ev: LayerEvent) -> None:
        pass


class _LayerCompute:
    """The runtime's compute for one call of an offloaded MoE layer (a
    :class:`~specprefetch.runtime.core.layer.LayerWork`): the provider's priorities from the router input, and the
    experts' MLPs over the cache slots -- transformers' eager loop (same op order: bit-identical results), or for a
    decoding token the batched fast path (``compute_opt``)."""

    __slots__ = ("rt", "mod", "hidden", "idx", "weights", "out", "idx_dev")

    def __init__(self, rt: OffloadedRuntime, mod: OffloadedExperts, hidden: Tensor, idx: Tensor,
                 weights: Tensor) -> None:
        self.rt, self.mod, self.hidden, self.idx, self.weights = rt, mod, hidden, idx, weights
        self.out: Tensor | None = None
        self.idx_dev: Tensor | None = None

    def scores(self, provider: PriorityProvider, layer: int) -> Any:
        return provider.scores(layer, self.hidden)

    def prepared(self, ev: LayerEvent, predicted: bool, batched: bool) -> None:
        if not batched:  # the eager loop accumulates into ``out`` expert by expert
            self.out = torch.zeros_like(self.hidden)
            self.idx_dev = self.idx.to(self.hidden.device)

    def expert(self, key: Key, slot: int) -> None:
        rt, hidden, weights = self.rt, self.hidden, self.weights
        pos, tok = torch.where(self.idx_dev.t() == key[1])
        y = rt.layout.mlp(rt.pool.weights(slot), hidden[tok], self.mod.act_fn) * weights[tok, pos, None]
        self.out.index_add_(0, tok, y.to(self.out.dtype))
        rt.pool.mark_used(slot)

    def batched(self, keys: list[Key], slots: list[int], release: Callable[[], None]) -> None:
        """One decoding token: gather the K experts' weights, two batched matmuls, fixed-order sum."""
        pool, hidden, act_fn = self.rt.pool, self.hidden, self.mod.act_fn
        # one token: its top-k ids are distinct, so sorting them gives ``keys``' order
        w = self.weights[0, torch.argsort(top_k_index_row(self.idx, self.weights.device))]
        if pool.gate_up is None:  # quantized or widened experts: one MLP each, summed in ascending id
            out = torch.zeros_like(hidden)
            for s, wk in zip(slots, w.unbind(0)):
                out.add_(self.rt.layout.mlp(pool.weights(s), hidden, act_fn) * wk)
            for s in slots:
                pool.mark_used(s)
            release()
            self.out = out
            return
        st = torch.tensor(slots, device=pool.device)
        gu = pool.gate_up.index_select(0, st)            # [E, 2I, H]
        dn = pool.down.index_select(0, st)                # [E, H, I]
        for s in slots:
            pool.mark_used(s)
        release()  # the weights are gathered: the slots may be refilled while the matmuls run
        x = hidden[0]
        gate, up = torch.matmul(gu, x).chunk(2, dim=-1)    # [E, I] each
        h = act_fn(gate) * up
        y = torch.bmm(dn, h.unsqueeze(-1)).squeeze(-1)     # [E, H]
        self.out = (y * w[:, None]).sum(dim=0, keepdim=True).to(hidden.dtype)

    def issued(self, ev: LayerEvent) -> None:
        pass

    def finish(self, provider: PriorityProvider | None) -> None:
        l = self.mod.ordinal
        self.rt._routing[l] = (self.idx, self.weights.detach())
        if provider is not None:
            provider.observe(l, *self.rt._routing[l])
