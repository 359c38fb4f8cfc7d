"""One model, one expert store, many measured runs: the harness behind window profiling and the benchmarks.

A run = a fresh :class:`OffloadedRuntime` (empty cache, or every expert resident; storage prepared, i.e. the
page cache evicted for ``nvme_cold``) decoding every prompt greedily; its result carries the decoding
throughput, the runtime counters, the generated tokens and (optionally) the timeline.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specprefetch.contracts import POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.decode import Generation, Prompt, greedy_generate
from specprefetch.runtime.engine import OffloadedRuntime, RuntimeOptions, install_offloaded
from specprefetch.runtime.paper_scale import install_store_experts, match_store
from specprefetch.runtime.priority import PreviousTokenPriority, PriorityProvider
from specprefetch.runtime.storage import ExpertReader, StorageProfile, make_profile
from specprefetch.runtime.store import ExpertStore, find_moe_blocks
from specprefetch.runtime.timeline import LayerEvent, RunStats

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
        return [g.new_ids for g in self.generations]


class Harness:
    """Runs the offloaded runtime on a model under the settings of the ``device`` section."""

    def __init__(self, model: nn.Module, spec: Any, store: ExpertStore, settings: dict[str, Any],
                 prompts: list[Prompt], providers: dict[str, Callable[[], PriorityProvider]],
                 device: str = "cpu", capacity: int | None = None, tokenizer: Any = None) -> None:
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
        from specprefetch.runtime.settings import cache_capacity

        self.capacity = capacity or cache_capacity(settings, store.total_experts, int(spec.top_k))
        self._readers: dict[str, ExpertReader] = {}

    def profile(self, storage: str) -> StorageProfile:
        return make_profile(storage, self.settings, self.store.layout.payload_bytes)

    def reader(self, storage: str) -> ExpertReader:
        if storage not in self._readers:
            self._readers[storage] = ExpertReader(self.store, self.profile(storage),
                                                  pin_memory=self.device.type == "cuda")
        return self._readers[storage]

    def provider(self, policy: str) -> PriorityProvider | None:
        pol = POLICY[policy]
        if not pol.predicts:
            return None
        if pol.provider is None:  # Naive Prefetch: the previous token's experts
            return PreviousTokenPriority(len(self.blocks), self.store.n_experts)
        key = pol.provider
        if key not in self.providers:
            raise SpecPrefetchError(f"policy {policy!r} needs a {key} predictor, none was given")
        return self.providers[key]()

    def plain_generations(self, max_new_tokens: int | None = None,
                          prompts: list[Prompt] | None = None) -> list[Generation]:
        """The plain model's greedy ``generate()``: every MoE block computes its experts from the store's records,
        all resident (:class:`~specprefetch.runtime.paper_scale.ResidentExperts`), with no runtime: the tokens
        every offloaded run must reproduce."""
        saved = install_store_experts(self.blocks, self.store, self.device)
        try:
            n_new = int(max_new_tokens or self.settings["max_new_tokens"])
            return [greedy_generate(self.model, p, n_new, fixed_length=True, tokenizer=self.tokenizer)
                    for p in prompts or self.prompts]
        finally:
            for b, mod in zip(self.blocks, saved):
                b.block.experts = mod

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def run(self, policy: str, storage: str, m_max: int = 0, compute_opt: bool = True, record: bool = False,
            preload: bool = False, capacity: int | None = None, topm_absent: tuple[int, ...] = (),
            max_new_tokens: int | None = None, prompts: list[Prompt] | None = None,
            on_runtime: Callable[[OffloadedRuntime], Any] | None = None,
            layer_m_max: tuple[int, ...] = ()) -> RunResult:
        """One measured run of ``policy`` (see the module docstring); ``layer_m_max``: per-layer budgets."""
        budgeted = POLICY[policy].budgeted
        opts = RuntimeOptions(policy=policy, m_max=m_max if budgeted else 0,
                              layer_m_max=tuple(layer_m_max) if budgeted else (),
                              capacity=capacity or self.capacity, compute_opt=compute_opt,
                              io_workers=int(self.settings["io_workers"]), io_retries=int(self.settings["io_retries"]),
                              record_routing=record, preload=preload, topm_absent=topm_absent)
        rt = OffloadedRuntime(self.model, self.store, self.reader(storage), opts, self.provider(policy),
                              spec=self.spec, device=self.device)
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
            for p in prompts or self.prompts:
                rt.new_sequence()
                gens.append(greedy_generate(self.model, p, n_new, fixed_length=True, tokenizer=self.tokenizer))
            wall = time.perf_counter() - t0
        finally:
            gc.enable()
            rt.uninstall()
            rt.close()
        res = RunResult(policy, storage, opts.m_max, compute_opt, rt.capacity, rt.stats(), gens, rt.events,
                        list(rt.engine.log), wall)
        log.info("%-12s %-9s M=%-2d opt=%d: %.2f tok/s, ReadyRecall %.3f, hits %d, misses %d, prefetched %d, "
                 "stall %.1f ms", policy, storage, opts.m_max, compute_opt, res.tokens_per_s,
                 res.stats.ready_recall, res.stats.hits, res.stats.misses, res.stats.prefetched, res.stats.stall_ms)
        return res
