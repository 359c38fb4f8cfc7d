"""Offloaded MoE runtime: expert store, cache, prefetcher, storage, window profiling, simulator, external logs.

Everything runs on tiny random transformers MoE models (Qwen3-MoE: fused experts, every layer MoE; DeepSeek-V2:
first layer dense, shared experts) built here, so the tests need no pipeline output.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.cache import CacheError, ExpertCache
from specprefetch.runtime.core.engine import POLICIES, OffloadedRuntime, OffloadError, RuntimeOptions
from specprefetch.runtime.core.priority import (
    PredictorPriority,
    PreviousTokenPriority,
    fate_from_model,
    select_prefetch,
)
from specprefetch.runtime.core.storage import ExpertReader, FaultInjector, make_profile
from specprefetch.runtime.core.store import ExpertStore, StoreError, build_expert_store
from specprefetch.runtime.core.timeline import LayerEvent, ready_recall_of, routing_rows, summarize
from specprefetch.runtime.measurement.window import CACHED_INTERFERENCE, HAND_OFFS

VOCAB = 96


def _device(**over: Any) -> dict[str, Any]:
    """A resolved ``device`` section (the schema's defaults) with ``over`` set."""
    from specprefetch.config import section_defaults

    return section_defaults("device", over)
NEW = 8  # tokens generated per run


def tiny_qwen() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=16, num_experts_per_tok=4, max_position_embeddings=128)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    return model


def tiny_deepseek() -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(1)
    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=12,
                           n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=8,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=128, topk_method="greedy", n_group=None, topk_group=None)
    model = DeepseekV2ForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    return model


def tiny_deepseek_vl2() -> Any:
    """Our DeepSeek-VL2 (multi-head attention, as DeepSeek-VL2-Tiny), text-only prompts."""
    from specprefetch.models.deepseek_vl2 import DeepseekVL2ForCausalLM
    from tests.test_deepseek_vl2 import tiny_config

    torch.manual_seed(2)
    model = DeepseekVL2ForCausalLM(tiny_config(vocab_size=VOCAB, n_routed_experts=12)).eval()
    model.language.set_experts_implementation("eager")
    return model


def random_adapter(spec: Any, seed: int = 0, lookahead: int = 1, method: str = "specprefetch") -> Any:
    """A SpecPrefetch adapter (or the pre-attention router, its low-rank form) with random (non-zero) weights: some
    ranking, not a trained one."""
    from specprefetch.predictors.base import PredictorDims, build_predictor

    torch.manual_seed(seed)
    dims = PredictorDims(n_layers=spec.n_layers, hidden_size=spec.hidden_size, n_experts=spec.n_experts,
                         top_k=spec.top_k, scoring=spec.scoring, arch=spec.arch, lookahead=lookahead)
    pred = build_predictor(method, {method: {"rank": 4}}, dims)
    with torch.no_grad():
        pred.B.normal_()
    return pred


def provider_for(policy: str, spec: Any, lookahead: int = 1) -> Any:
    if policy == "naive":
        return PreviousTokenPriority(spec.n_layers, spec.n_experts, lookahead)
    if policy == "fate":
        return PredictorPriority(fate_from_model(spec, lookahead))
    if policy in ("specprefetch", "pred0"):
        return PredictorPriority(random_adapter(spec))
    if policy == "pre_attention":
        return PredictorPriority(random_adapter(spec, method="pre_attention"))
    return None


@pytest.fixture(scope="module", params=["qwen", "deepseek", "deepseek_vl2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from specprefetch.models.routing import discover_routing

    model = {"qwen": tiny_qwen, "deepseek": tiny_deepseek, "deepseek_vl2": tiny_deepseek_vl2}[request.param]()
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path_factory.mktemp("store") / "experts", model_name="t"))
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 8))
    ref = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    # a batch of 3 prompts, and the plain model's batched greedy decode of it (before any test offloads the experts)
    bids, bmask = _batch_ids(3)
    bref = model.generate(bids, attention_mask=bmask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          pad_token_id=0)
    return {"model": model, "spec": spec, "store": store, "ids": ids, "ref": ref, "name": request.param,
            "batch": (bids, bmask, bref)}


def run_policy(s: dict[str, Any], policy: str, storage: str = "ram", m_max: int = 4, capacity: int = 0,
               compute_opt: bool = True, faults: FaultInjector | None = None, sync: bool = False,
               io_workers: int = 2, record: bool = False,
               layer_m_max: tuple[int, ...] = (), lookahead: int = 1) -> tuple[torch.Tensor, OffloadedRuntime]:
    store = s["store"]
    prof = make_profile(storage, _device(emulation="bandwidth"), store.layout.payload_bytes)
    reader = ExpertReader(store, prof, faults=faults, verify=True)
    cap = capacity or 2 * s["spec"].top_k + m_max
    opts = RuntimeOptions(policy=policy, m_max=m_max, capacity=cap, compute_opt=compute_opt, io_workers=io_workers,
                          sync_prefetch=sync, record_routing=record, layer_m_max=layer_m_max, lookahead=lookahead)
    rt = OffloadedRuntime(s["model"], store, reader, opts, provider_for(policy, s["spec"], lookahead),
                          spec=s["spec"])
    try:
        rt.install()
        rt.reset_run()
        out = s["model"].generate(s["ids"], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        rt.uninstall()
        rt.close()
        reader.close()
    return out, rt


# ------------------------------------------------------------------------------------------ store
def test_store_layout_and_verification(setup: dict[str, Any]) -> None:
    store = setup["store"]
    m = store.manifest
    assert m["n_layers"] == setup["spec"].n_layers and m["n_experts"] == setup["spec"].n_experts
    assert store.record_bytes % 4096 == 0 and store.record_bytes >= store.layout.payload_bytes
    blocks = __import__("specprefetch.runtime.core.store", fromlist=["find_moe_blocks"]).find_moe_blocks(setup["model"])
    # a record is exactly the expert's weights
    for layer in (0, store.n_layers - 1):
        rec = torch.frombuffer(bytearray(next(iter(dict(store.read_all(layer)).values()))), dtype=torch.uint8)
        gu, dn = store.layout.views(rec)
        assert torch.equal(gu, blocks[layer].experts.gate_up_proj[0].detach())
        assert torch.equal(dn, blocks[layer].experts.down_proj[0].detach())
    assert (store.files[0].stat().st_size == store.record_bytes * store.n_experts)


def test_corrupt_store_is_rejected(setup: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(setup["store"].root, bad)
    f = bad / "layer-001.bin"
    data = bytearray(f.read_bytes())
    data[setup["store"].record_bytes * 2 + 5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"layer-001\.bin.*expert 2"):
        ExpertStore(bad)
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(StoreError, match="truncated"):
        ExpertStore(bad, verify=False)


# ------------------------------------------------------------------------------------------ runtime
@pytest.mark.parametrize("compute_opt", [False, True])
def test_identical_tokens_for_every_policy(setup: dict[str, Any], compute_opt: bool) -> None:
    """The router decides: every policy, prefetch on or off, produces the plain model's greedy tokens."""
    for policy in POLICIES:
        out, rt = run_policy(setup, policy, compute_opt=compute_opt)
        assert torch.equal(out, setup["ref"]), f"{setup['name']} {policy} compute_opt={compute_opt}"
        st = rt.stats()
        assert st.n_tokens == NEW - 1 and 0.0 <= st.ready_recall <= 1.0
        if policy == "resident":
            assert st.ready_recall == 1.0 and st.misses == 0
        if policy in ("off", "pred0", "resident"):
            assert st.prefetched == 0 and not any(tr.kind == "prefetch" for tr in rt.engine.log)
        if policy in ("specprefetch", "fate"):
            assert st.prefetched > 0


def test_cache_never_exceeds_capacity(setup: dict[str, Any]) -> None:
    k = setup["spec"].top_k
    for capacity in (k, k + 2):
        out, rt = run_policy(setup, "specprefetch", storage="nvme", m_max=6, capacity=capacity, compute_opt=False)
        assert torch.equal(out, setup["ref"])
        assert rt.cache.peak_used <= capacity
        assert rt.pool.data.shape[0] == capacity  # the bytes themselves are bounded
        assert rt.cache.evictions > 0


def test_io_errors_are_retried_or_served_on_demand(setup: dict[str, Any]) -> None:
    faults = FaultInjector(rate=0.3, seed=3)
    out, rt = run_policy(setup, "specprefetch", faults=faults, io_workers=3)
    assert torch.equal(out, setup["ref"])
    assert faults.failures > 0 and rt.stats().io_errors == faults.failures
    # a prefetch whose every attempt fails is dropped; the expert is then loaded on demand
    faults = FaultInjector(fail_keys={(1, e) for e in range(setup["spec"].n_experts)}, max_failures=9)
    out, rt = run_policy(setup, "fate", faults=faults)
    assert torch.equal(out, setup["ref"])
    assert any(tr.state == "failed" for tr in rt.engine.log)


def test_unreadable_expert_raises_never_wrong_output(setup: dict[str, Any]) -> None:
    from specprefetch.runtime.core.storage import StorageError

    faults = FaultInjector(fail_keys={(0, e) for e in range(setup["spec"].n_experts)})
    with pytest.raises(StorageError, match="could not be read"):
        run_policy(setup, "off", faults=faults)


def test_m_max_zero_equals_off(setup: dict[str, Any]) -> None:
    out_off, off = run_policy(setup, "off", m_max=0, capacity=setup["spec"].top_k + 3, sync=True, io_workers=1)
    out_sp, sp = run_policy(setup, "specprefetch", m_max=0, capacity=setup["spec"].top_k + 3, sync=True,
                            io_workers=1)
    assert torch.equal(out_off, out_sp)
    a, b = off.stats(), sp.stats()
    assert (a.hits, a.misses, a.prefetched, a.ready_recall) == (b.hits, b.misses, b.prefetched, b.ready_recall)
    assert b.prefetched == 0


def test_prefill_loads_take_no_emulated_delay(setup: dict[str, Any]) -> None:
    """Decoding throughput excludes prefill: its loads skip the emulated device, every decoding load is charged."""
    _, rt = run_policy(setup, "specprefetch", storage="sdcard", m_max=2, capacity=setup["spec"].top_k + 4)
    tokens_of_step = {ev.step: ev.n_tokens for ev in rt.events}
    log = rt.engine.log
    assert any(tokens_of_step[tr.step] > 1 for tr in log) and any(tokens_of_step[tr.step] == 1 for tr in log)
    assert all(tr.charged == (tokens_of_step[tr.step] == 1) for tr in log)
    store = setup["store"]
    reader = ExpertReader(store, make_profile("sdcard", _device(emulation="bandwidth"), store.layout.payload_bytes))
    try:
        buf = torch.empty(store.record_bytes, dtype=torch.uint8)
        reader.read(0, 1, buf, charged=False)
        assert reader.model.queue == []  # the device model was not reserved
        reader.read(0, 1, buf)
        assert len(reader.model.queue) == 1
    finally:
        reader.close()


def test_simulator_does_not_charge_prefill() -> None:
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, SimSequence, SimStep, simulate

    prefill = SimStep(topk=[[[0, 1], [2, 3]], [[0, 1], [4, 5]]])  # two prompt tokens
    decode = SimStep(topk=[[[6, 7]], [[6, 7]]])
    zero = [0.0, 0.0]
    prof = ComputeProfile(zero, zero, zero, [1e-4] * 2, zero, 1e-4)
    storage = StorageProfile("sdcard", "emulated", 1000.0, 0.0, 1e6)  # 1 ms per expert
    res = simulate([SimSequence([prefill, decode])], "off", 0, 8, 8, 2, prof, storage, io_workers=1)
    ev = {(e.step, e.layer): e for e in res.events}
    assert ev[(0, 0)].stall_s == ev[(0, 1)].stall_s == 0.0
    assert ev[(1, 0)].stall_s == pytest.approx(2e-3) and ev[(1, 1)].stall_s == pytest.approx(2e-3)
    assert res.stats.misses == 4  # decoding steps only


def test_ready_recall_on_scripted_timeline() -> None:
    # K = 2; layer 0 is not a target layer of the definition, layers 1 and 2 are.
    evs = [
        LayerEvent(step=0, layer=0, n_tokens=1, t_exec=0.0, required=[0, 1], hits=0, inflight=0, misses=2,
                   ready_pairs=0),
        LayerEvent(step=0, layer=1, n_tokens=1, t_exec=1.0, required=[2, 3], hits=1, inflight=1, misses=0,
                   ready_pairs=1),
        LayerEvent(step=0, layer=2, n_tokens=1, t_exec=2.0, required=[4, 5], hits=2, inflight=0, misses=0,
                   ready_pairs=2),
        LayerEvent(step=1, layer=1, n_tokens=1, t_exec=3.0, required=[2, 7], hits=0, inflight=0, misses=2,
                   ready_pairs=0),
        # a prefill event (3 tokens) is not a decoding step
        LayerEvent(step=2, layer=1, n_tokens=3, t_exec=4.0, required=[1, 2], hits=2, inflight=0, misses=0,
                   ready_pairs=6),
    ]
    # hand computation: (1/2 + 2/2 + 0/2) / 3 target (token, layer) pairs = 0.5
    assert summarize(evs, top_k=2).ready_recall == pytest.approx(0.5)
    assert ready_recall_of([[2, 3]], {3, 9}, 2) == 0.5
    assert ready_recall_of([[1, 2], [2, 4]], {2}, 2) == 0.5


def test_ready_recall_measured_matches_definition(setup: dict[str, Any]) -> None:
    """Recorded events: ReadyRecall recomputed from each event's top-k and its hits equals the summary."""
    _, rt = run_policy(setup, "fate", record=True)
    st = rt.stats()
    k = setup["spec"].top_k
    vals = [ev.hits / k for ev in rt.events if ev.n_tokens == 1 and ev.layer >= 1]
    assert st.ready_recall == pytest.approx(sum(vals) / len(vals))


def test_select_prefetch_excludes_available_and_keeps_priority_order() -> None:
    s = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.0, 0.3])
    assert select_prefetch(s, {1}, 3) == [3, 2, 5]
    assert select_prefetch(s, set(), 0) == []
    assert select_prefetch(s, {1, 3}, 10, empty_when_zero=True) == [2, 5, 0]


def test_cache_bookkeeping() -> None:
    c = ExpertCache(2)
    assert c.reserve((0, 1)) is not None and c.reserve((0, 2)) is not None
    c.fill((0, 1))
    c.pin((0, 1))
    assert c.reserve((0, 3)) is None  # (0,1) pinned, (0,2) in flight
    c.fill((0, 2))
    assert c.reserve((0, 3), protect={(0, 2)}, last_resort=False) is None
    assert c.reserve((0, 3)) is not None  # last resort: the protected, unpinned one
    assert not c.is_resident((0, 2)) and c.is_resident((0, 1)) and c.used == 2
    with pytest.raises(CacheError):
        c.unpin((0, 3))


# ------------------------------------------------------------------------------------------ simulator
@pytest.mark.parametrize("policy", ["off", "specprefetch", "naive", "fate", "pred0", "pre_attention"])
def test_simulator_matches_runtime_counters(setup: dict[str, Any], policy: str) -> None:
    """Deterministic case (one I/O worker, every transfer completes before the next layer): same counters."""
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, sequences_from_record, simulate

    k, n_layers = setup["spec"].top_k, setup["spec"].n_layers
    cap = k + 3
    _, rt = run_policy(setup, policy, m_max=3, capacity=cap, sync=True, io_workers=1, record=True)
    seqs = sequences_from_record(routing_rows(rt.events), n_layers)
    zero = [0.0] * n_layers
    prof = ComputeProfile(zero, zero, zero, [1e-3] * n_layers, zero, 1e-3)
    sim = simulate(seqs, policy, 3, cap, setup["spec"].n_experts, k, prof, StorageProfile("ram", "ram"),
                   io_workers=1, compute_opt=True, sync=True, fixed_transfer_s=0.0)
    a, b = rt.stats(), sim.stats
    for field_name in ("n_tokens", "hits", "misses", "inflight", "demand_loads", "prefetched", "wasted", "cancelled"):
        assert getattr(a, field_name) == getattr(b, field_name), field_name
    assert a.ready_recall == pytest.approx(b.ready_recall)
    assert b.peak_cache_experts <= cap


@pytest.mark.parametrize("policy", ["specprefetch", "naive"])
def test_per_layer_budgets_in_runtime_and_simulator(setup: dict[str, Any], policy: str) -> None:
    """``layer_m_max``: each layer's prefetches stay within its own budget (none into a layer of budget 0), the
    tokens are the plain model's, and the simulator, given the same budgets, makes the same decisions."""
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, sequences_from_record, simulate

    k, n_layers = setup["spec"].top_k, setup["spec"].n_layers
    budgets = tuple([3] + [(0, 1, 3)[layer % 3] for layer in range(1, n_layers)])
    cap = k + 3
    out, rt = run_policy(setup, policy, m_max=3, capacity=cap, sync=True, io_workers=1, record=True,
                         layer_m_max=budgets)
    assert torch.equal(out, setup["ref"])
    per_layer: dict[int, int] = defaultdict(int)
    for ev in rt.events:
        assert len(ev.candidates) <= budgets[ev.layer + 1] if ev.layer + 1 < n_layers else True
        per_layer[ev.layer] += ev.prefetch_used + ev.prefetch_wasted + ev.prefetch_cancelled
    assert all(per_layer[layer] == 0 for layer in range(1, n_layers) if budgets[layer] == 0)
    assert any(per_layer[layer] > 0 for layer in range(1, n_layers) if budgets[layer] > 0)
    seqs = sequences_from_record(routing_rows(rt.events), n_layers)
    zero = [0.0] * n_layers
    prof = ComputeProfile(zero, zero, zero, [1e-3] * n_layers, zero, 1e-3)
    sim = simulate(seqs, policy, 3, cap, setup["spec"].n_experts, k, prof, StorageProfile("ram", "ram"),
                   io_workers=1, compute_opt=True, sync=True, fixed_transfer_s=0.0, layer_m_max=budgets)
    a, b = rt.stats(), sim.stats
    for name in ("hits", "misses", "prefetched", "wasted", "cancelled"):
        assert getattr(a, name) == getattr(b, name), name
    with pytest.raises(OffloadError, match="m_max must be >= 0"):
        RuntimeOptions(policy="specprefetch", m_max=2, layer_m_max=(2, -1))
    assert RuntimeOptions(m_max=4, layer_m_max=(4, 1, 2)).budget_of(2) == 2
    assert RuntimeOptions(m_max=4).budget_of(2) == 4


@pytest.mark.parametrize("policy", ["fate", "naive"])
def test_lookahead_prefetches_d_layers_ahead_in_runtime_and_simulator(setup: dict[str, Any], policy: str) -> None:
    """``lookahead = 2`` (beyond the paper): layer l prefetches into layer l+2 only (nothing ever into layers 0 and
    1, no prediction in the last two layers), the tokens are the plain model's, and the simulator replaying the run
    with the same look-ahead makes the same decisions. A provider predicting another distance is refused."""
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, sequences_from_record, simulate

    k, n_layers = setup["spec"].top_k, setup["spec"].n_layers
    assert n_layers >= 3
    cap = 2 * k + 3
    out, rt = run_policy(setup, policy, m_max=3, capacity=cap, sync=True, io_workers=1, record=True, lookahead=2)
    assert torch.equal(out, setup["ref"])
    into: dict[int, int] = defaultdict(int)  # prefetches counted at the layer they were issued into
    for ev in rt.events:
        into[ev.layer] += ev.prefetch_used + ev.prefetch_wasted + ev.prefetch_cancelled
        if ev.layer + 2 >= n_layers:
            assert ev.candidates == [] and ev.issued == [], ev
    assert into[0] == into[1] == 0
    # FATE always prefetches something; Naive Prefetch's previous-token experts may all be cached already
    assert sum(into[layer] for layer in range(2, n_layers)) > 0 or policy == "naive"
    assert any(ev.scores is not None for ev in rt.events if ev.n_tokens == 1 and ev.layer + 2 < n_layers)
    seqs = sequences_from_record(routing_rows(rt.events), n_layers)
    zero = [0.0] * n_layers
    prof = ComputeProfile(zero, zero, zero, [1e-3] * n_layers, zero, 1e-3)
    sim = simulate(seqs, policy, 3, cap, setup["spec"].n_experts, k, prof, StorageProfile("ram", "ram"),
                   io_workers=1, compute_opt=True, sync=True, fixed_transfer_s=0.0, lookahead=2)
    for name in ("hits", "misses", "prefetched", "wasted", "cancelled"):
        assert getattr(rt.stats(), name) == getattr(sim.stats, name), name
    reader = ExpertReader(setup["store"], make_profile("ram", _device(), setup["store"].layout.payload_bytes))
    with pytest.raises(OffloadError, match="prefetches 1 layer\\(s\\) ahead, but its .* predicts 2"):
        OffloadedRuntime(setup["model"], setup["store"], reader, RuntimeOptions(policy=policy, m_max=3),
                         provider_for(policy, setup["spec"], 2), spec=setup["spec"])
    with pytest.raises(OffloadError, match="lookahead must be an integer >= 1"):
        RuntimeOptions(policy=policy, lookahead=0)
    reader.close()


def test_run_timing_service_time_is_the_union_of_transfer_intervals() -> None:
    """The simulator's ``run`` inputs: overlapping transfers count their union once (the device's busy time);
    prefill transfers and uncharged ones are left out."""
    from types import SimpleNamespace

    from specprefetch.runtime.core.timeline import LayerEvent
    from specprefetch.runtime.measurement.bench import run_timing

    def tr(step: int, a: float, b: float, charged: bool = True) -> Any:
        return SimpleNamespace(state="done", charged=charged, step=step, t_start=a, t_end=b, inline=False)

    events = [LayerEvent(step=0, layer=0, n_tokens=5, t_exec=0.0, required=[0], hits=0, inflight=0, misses=1,
                         ready_pairs=0),
              LayerEvent(step=1, layer=0, n_tokens=1, t_exec=1.0, required=[0], hits=0, inflight=0, misses=1,
                         ready_pairs=0, t_compute=1.0, t_ready=1.0, t_done=1.5)]
    transfers = [tr(0, 0.1, 0.9), tr(1, 1.0, 1.004), tr(1, 1.002, 1.006), tr(1, 1.010, 1.012),
                 tr(1, 1.0, 1.5, charged=False)]
    res = SimpleNamespace(events=events, transfers=transfers)
    t = run_timing(res, 1)
    assert t["n_transfers"] == 3
    assert t["transfer_ms"] == pytest.approx((4 + 4 + 2) / 3)
    assert t["service_ms"] == pytest.approx((6 + 2) / 3)  # [1.000, 1.006] and [1.010, 1.012]
    assert t["compute"]["moe_s"] == [pytest.approx(0.5)]
    none = run_timing(SimpleNamespace(events=events, transfers=[]), 1)
    assert none["n_transfers"] == 0 and math.isnan(none["service_ms"])


def test_simulator_overlap_and_budget() -> None:
    """Timing logic on a scripted sequence: prefetching hides transfers inside the window, over-budget stalls."""
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, SimSequence, SimStep, simulate

    n_layers, n, k = 3, 8, 2
    rng = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(20):
        topk = [[sorted(torch.randperm(n, generator=rng)[:k].tolist())] for _ in range(n_layers)]
        scores = [None] * n_layers
        for l in range(n_layers - 1):  # an oracle priority: the next layer's true experts first
            s = torch.zeros(n)
            s[topk[l + 1][0]] = 1.0
            scores[l] = s
        steps.append(SimStep(topk=topk, scores=scores))
    seqs = [SimSequence(steps)]
    prof = ComputeProfile([1e-5] * 3, [1e-5] * 3, [0.0] * 3, [1e-3] * 3, [1e-3] * 3, 1e-3)
    storage = StorageProfile("nvme", "emulated", 1000.0, 0.0, 0.4e6)  # 0.4 ms per expert
    off = simulate(seqs, "off", 0, 2 * k, n, k, prof, storage, io_workers=2)
    sp = simulate(seqs, "specprefetch", k, 2 * k, n, k, prof, storage, io_workers=2)
    res = simulate(seqs, "resident", 0, 2 * k, n, k, prof, storage, io_workers=2)
    assert sp.stats.ready_recall > off.stats.ready_recall
    assert off.tokens_per_s < sp.tokens_per_s <= res.tokens_per_s * 1.0001
    assert res.stats.ready_recall == 1.0 and res.stats.stall_ms == 0.0
    # per decoding step the OFF stall is at least the serial data time of its demand loads (bandwidth model)
    assert off.stats.stall_ms >= 0.4 * off.stats.demand_loads / 2 - 1e-6


# ------------------------------------------------------------------------------------------ external logs
def _external_rows() -> list[dict[str, Any]]:
    base = {"platform": "snapdragon_8_elite", "model": "deepseek-vl2-tiny", "experiment": "main",
            "storage": "nvme_cold", "compute_opt": "true", "repeat": 0}
    return [{**base, "policy": "off", "m_max": 0, "tokens_per_s": 3.75, "ready_recall": ""},
            {**base, "policy": "specprefetch", "m_max": 8, "tokens_per_s": 4.05, "ready_recall": 0.917}]


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_external_log_is_validated_and_merged(tmp_path: Path) -> None:
    from specprefetch.runtime.measurement.external import collect_device_benchmarks, read_external_log

    good = _write_csv(tmp_path / "phone.csv", _external_rows())
    rows = read_external_log(good)
    assert [r["source"] for r in rows] == ["external:phone.csv"] * 2 and rows[1]["ready_recall"] == 0.917
    jl = tmp_path / "phone2.jsonl"
    jl.write_text("\n".join(json.dumps({**r, "platform": "phone2"}) for r in _external_rows()) + "\n")
    out = tmp_path / "runs.csv"
    merged = collect_device_benchmarks([], [good, jl], out)
    assert len(merged) == 4 and out.read_text().splitlines()[0].startswith("platform,model,experiment")


@pytest.mark.parametrize("bad,line,what", [
    ({"ready_recall": 91.7}, 3, "ready_recall"),
    ({"policy": "oracle"}, 3, "policy"),
    ({"tokens_per_s": -1}, 3, "tokens_per_s"),
    ({"m_max": "eight"}, 3, "m_max"),
    ({"compute_opt": "maybe"}, 3, "compute_opt"),
])
def test_malformed_external_log_names_file_and_line(tmp_path: Path, bad: dict[str, Any], line: int,
                                                    what: str) -> None:
    from specprefetch.runtime.measurement.external import ExternalLogError, read_external_log

    rows = _external_rows()
    rows[1] = {**rows[1], **bad}
    path = _write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(ExternalLogError, match=rf"bad\.csv:{line}: .*{what}"):
        read_external_log(path)
    jl = tmp_path / "bad.jsonl"
    jl.write_text(json.dumps(rows[0]) + "\n" + "{not json\n")
    with pytest.raises(ExternalLogError, match=r"bad\.jsonl:2: not valid JSON"):
        read_external_log(jl)
    dup = _write_csv(tmp_path / "dup.csv", [rows[0], rows[0]])
    with pytest.raises(ExternalLogError, match=r"dup\.csv:3: duplicate run"):
        read_external_log(dup)


# ------------------------------------------------------------------------------------------ window + bench + simulate
def test_profile_window_bench_and_simulator_validation(tmp_path: Path) -> None:
    """The rules' library path on a tiny model: window files per the contract, runs rows, simulator replay."""
    import csv

    from specprefetch.config import section_defaults
    from specprefetch.contracts import RUN_COLUMNS
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.measurement.bench import bench_runtime
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness
    from specprefetch.runtime.measurement.window import profile_window
    from specprefetch.runtime.simulation.simrun import summarize_validation, validate_simulator

    model = tiny_deepseek()
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec))
    s = section_defaults("device", {"n_prompts": 1, "max_new_tokens": 5, "repeats": 1, "io_workers": 2,
                                 "storages": ["nvme_cold", "slow_ufs"],
                                 "experiments": ["main", "matched", "component", "lookahead", "pre_attention"],
                                 "lookahead": {"distances": [1, 2], "storages": ["nvme_cold"]},
                                 "window": {"n_prompts": 1, "demand_m": [2, 4], "transfer_samples": 4},
                                 "cache": {"capacity_experts": 8}, "max_block_runs": 6})
    prompts = [Prompt("p0", {"input_ids": torch.randint(0, VOCAB, (1, 6)), "attention_mask": torch.ones(1, 6).long()})]
    providers = provider_factories({}, spec, "cpu")
    adapter = random_adapter(spec)
    providers["specprefetch"] = lambda: PredictorPriority(adapter)
    ahead = random_adapter(spec, lookahead=2)
    providers["specprefetch.d2"] = lambda: PredictorPriority(ahead)
    pre = random_adapter(spec, method="pre_attention")
    providers["pre_attention"] = lambda: PredictorPriority(pre)
    h = Harness(model, spec, store, s, prompts, providers)
    from specprefetch.runtime.simulation.budget_model import budget_curves

    try:
        prof = profile_window(h, "tiny", "test-cpu", tmp_path / "window",
                              budget_model=lambda p, r: budget_curves(p, r, s))
        assert 1 <= prof["m_max"] <= spec.n_experts and prof["window_ms_mean"] > 0
        # the pre-attention window (layer l+1's attention) is part of the layer's window, and has its own budgets
        assert 0 < prof["window_ms_median_pre_attention"] < prof["window_ms_median"]
        assert set(prof["m_max_pre_attention_per_storage"]) == set(prof["m_max_per_storage"])
        fl = prof["disk_fluctuation"]  # the cold disk's batch medians, in ms, and their spread
        assert len(fl["batch_median_ms"]) == fl["batches"] and fl["min_ms"] <= fl["max_ms"] <= fl["read_max_ms"]
        assert fl["cv_pct"] >= 0 and fl["batch_s"] > 0
        # what the I/O takes from the compute, fitted on a lockstep block of the reference storage's OFF, resident,
        # predicting and prefetching runs (M = 1 and K), and the loads it was fitted to; the block's compute
        lock = prof["compute_lockstep"]
        assert set(lock) == {"opt", "pred", "loop", "loop_scale"} and lock["loop_scale"] > 0
        assert len(lock["opt"]["moe_s"]) == spec.n_layers and all(t > 0 for t in lock["opt"]["moe_s"])
        io = prof["io_interference"]
        assert all(io[k] >= 0 for k in ("cpu_per_demand_ms", "cpu_per_issue_ms", "cpu_per_prefetch_ms"))
        assert set(io["runs"]) == {"resident", "off", "predicting", "prefetching_m1", f"prefetching_m{spec.top_k}"}
        assert io["runs"]["resident"]["demand"] == 0 < io["runs"]["off"]["demand"]
        assert io["runs"]["prefetching_m1"]["prefetches"] < io["runs"][f"prefetching_m{spec.top_k}"]["prefetches"]
        # the disk's service time per expert in each run that loaded one (OFF's: its loads one after another, the
        # simulator's serial service time); none in the runs without a load (profile.json holds finite numbers only)
        assert io["runs"]["off"]["service_ms"] > 0 and "service_ms" not in io["runs"]["resident"]
        # the thread hand-offs of the loads a worker served (back to the compute thread that waited, to a worker that
        # slept), pooled over the runs: prefetching runs wake their workers
        assert all(io[ms] >= 0 and all(r[n] >= 0 and r[ms] >= 0 for r in io["runs"].values())
                   for ms, n in HAND_OFFS.items())
        assert io["runs"][f"prefetching_m{spec.top_k}"]["starts"] > 0 and io["start_ms"] > 0
        assert CACHED_INTERFERENCE not in prof  # the delay emulation: every storage's loads read the disk
        rows = bench_runtime(h, prof, "tiny", "test-cpu", tmp_path / "runs.csv", routing_out=tmp_path / "r.safetensors")
    finally:
        h.close()
    with open(tmp_path / "window" / "window.csv") as f:
        win = list(csv.DictReader(f))
    assert list(win[0]) == ["platform", "model", "layer", "window_ms", "transfer_ms", "m_max"]
    assert [int(r["layer"]) for r in win] == list(range(1, spec.n_layers))
    with open(tmp_path / "window" / "window_events.csv") as f:
        assert {r["M"] for r in csv.DictReader(f)} == {"2", "4"}
    from specprefetch.contracts import EMULATED, check_csv

    host = check_csv(tmp_path / "window" / "host.csv", "host")  # what the host gave the runs, per storage
    assert set(host["storage"]) == set(prof["transfer_ms_used"])
    for _, r in host.iterrows():
        assert r["m_max"] == prof["m_max_per_storage"][r["storage"]]
        w_over_t = prof["window_ms_median"] / prof["transfer_ms_used"][r["storage"]]
        assert r["w_over_t"] == pytest.approx(w_over_t, rel=1e-4)  # host.csv keeps 6 significant digits
        assert (r["emulation"] != "none") == (r["storage"] in EMULATED) and r["compute_ms"] > 0
    # the simulated rule: a budget per storage from the sweep's range, and the simulator's curves (contract-checked)
    curve = check_csv(tmp_path / "window" / "budget_curve.csv", "budget_curve")
    sim = prof["m_max_simulated_per_storage"]
    assert set(sim) == set(prof["m_max_per_storage"]) and all(1 <= m <= max(s["sweep_m_max"]) for m in sim.values())
    budget = curve[curve["curve"] == "budget"]
    for st, m in sim.items():
        mine = budget[budget["storage"] == st]
        assert sorted(mine["m_max"]) == list(range(1, max(s["sweep_m_max"]) + 1))
        assert mine.loc[mine["tokens_per_s"].idxmax(), "m_max"] == m  # the fastest (the smaller on a tie)
    wt = curve[curve["curve"] == "w_over_t"]
    assert set(wt["rule"]) == {"window", "simulated"} and wt["w_over_t"].nunique() == 9
    assert (curve["emulation"] == s["emulation"]).all() and (curve["io_order"] == s["io_order"]).all()
    with open(tmp_path / "window" / "latency.csv") as f:
        lat = list(csv.DictReader(f))
    assert {r["mode"] for r in lat} == {"resident", "on_demand"}
    assert {r["component"] for r in lat} == {"attention", "router", "expert_load", "moe_compute", "other"}
    with open(tmp_path / "runs.csv") as f:
        got = list(csv.DictReader(f))
    # every row says how it was measured: emulation, I/O order and whose budget each storage ran at
    assert {(r["emulation"], r["io_order"], r["budget_scope"]) for r in got} == {
        (s["emulation"], s["io_order"], s["budget_scope"])}
    # the lookahead experiment: OFF and d = 1 are the component block's runs (same configuration), d = 2 its own run,
    # at the window rule's budget on two windows, and its control, d = 1 at d = 2's budget (unless that is d = 1's)
    from specprefetch.runtime.core.budget import derive_m_max

    m1 = int(prof["m_max_per_storage"]["nvme_cold"])
    m2 = derive_m_max(2 * prof["window_ms_median"], prof["transfer_ms_used"]["nvme_cold"], spec.n_experts)
    control = int(m2 != m1)
    # the pre_attention experiment on the reference and the slow storage: OFF, SpecPrefetch, and the pre-attention
    # policy at its own budget and at SpecPrefetch's (one run where they are the same), each the budget the storage
    # runs at (the reference storage's on every storage, device.budget_scope platform)
    from specprefetch.runtime.core.budget import pre_attention_budgets, storage_budgets

    budgets = storage_budgets(s, prof)
    pre = pre_attention_budgets(s, prof, budgets)
    pre_runs = sum(3 + int(pre[st] != budgets[st]) for st in ("nvme_cold", "slow_ufs"))
    assert list(got[0])[:17] == RUN_COLUMNS[:17] and len(got) == len(rows) == 6 + 8 + 4 + 3 + control + pre_runs
    ahead_rows = {(int(r["lookahead"]), int(r["m_max"])): r for r in got
                  if r["experiment"] == "lookahead" and r["policy"] != "off"}
    assert set(ahead_rows) == {(1, m1), (2, m2), (1, m2)}
    assert all(r["lookahead"] == "1" for r in got if r["experiment"] != "lookahead")
    assert ahead_rows[(1, m1)]["measured_in"] == "component" and ahead_rows[(2, m2)]["measured_in"] == "lookahead"
    assert ahead_rows[(1, m2)]["measured_in"] == ("lookahead" if control else "component")
    assert {r["policy"] for r in got if r["experiment"] == "main"} == set(s["main_policies"])
    assert {(r["compute_opt"], r["policy"]) for r in got if r["experiment"] == "component"} == {
        ("false", "off"), ("false", "specprefetch"), ("true", "off"), ("true", "specprefetch")}
    for r in got:
        assert float(r["tokens_per_s"]) > 0 and 0 <= float(r["ready_recall"]) <= 1 and r["tokens_match"] == "true"
        # against the trained model's own greedy decode (its own experts, not the store's): the tiny test model's
        # store keeps its experts as they are, so tokens and every routed expert set are the trained model's
        assert r["tokens_match_trained"] == "true" and int(r["routing_sets"]) > 0
        assert int(r["routing_diff_trained"]) == 0
        assert float(r["bound_tokens_per_s"]) > 0 and len(r["tokens_sha256"]) == 64
        assert float(r["bound_own_tokens_per_s"]) > 0
        assert int(r["peak_cache_experts"]) <= int(r["capacity_experts"])
    # blocks of at most 6 configurations: main and matched share the cold disk's first block (a configuration both
    # run is one run, measured_in names the first experiment); component is a block of its own, with its own OFF
    by = {(r["experiment"], r["policy"], r["storage"], r["compute_opt"]): r for r in got}
    for pol in ("off", "naive", "specprefetch", "fate"):
        reused, orig = by[("matched", pol, "nvme_cold", "true")], by[("main", pol, "nvme_cold", "true")]
        assert reused["measured_in"] == "main" and reused["tokens_per_s"] == orig["tokens_per_s"]
        assert reused["block"] == "nvme_cold"
        assert by[("matched", pol, "slow_ufs", "true")]["measured_in"] == "matched"
    assert {(r["compute_opt"], r["measured_in"], r["block"]) for r in got if r["experiment"] == "component"} == {
        ("true", "component", "nvme_cold#2"), ("false", "component", "nvme_cold#2")}
    assert by[("component", "off", "nvme_cold", "true")]["tokens_sha256"] == by[("main", "off", "nvme_cold",
                                                                                 "true")]["tokens_sha256"]
    # runs: main's, component's + d2 (+ its control), slow_ufs's
    # and those the pre_attention experiment measured itself: at least the pre-attention policy's
    own = {(r["block"], r["run_order"]) for r in got if r["measured_in"] == "pre_attention"}
    assert len(own) >= len({(r["storage"], r["m_max"]) for r in got if r["policy"] == "pre_attention"}) > 0
    assert len({(r["block"], r["run_order"]) for r in got}) == 6 + 5 + control + 4 + len(own)
    from specprefetch.contracts import ROUTING_FORMAT, load_tensor_tree
    from specprefetch.runtime.simulation.simrun import check_routing_record

    record = load_tensor_tree(tmp_path / "r.safetensors", ROUTING_FORMAT, "routing record")
    check_routing_record(record, tmp_path / "r.safetensors", "tiny")
    val = validate_simulator(record, prof, s)
    err = summarize_validation(val)
    plain = [v for v in val if v["metric"] not in ("speedup", "service_ms")]
    assert len(plain) == len(record["runs"]) * 7 * 2 and set(err) == {"profile", "run"}
    # the disk's service time, the profile's against each run's own: every run on the disk itself that transferred
    # (a delay-emulated storage reads the disk too, but its loads' service time holds their delays)
    service = [v for v in val if v["metric"] == "service_ms"]
    on_disk = [r for r in record["runs"].values() if r["row"]["policy"] != "resident"
               and r["row"]["storage"] == "nvme_cold"]
    assert service and len(service) == len(on_disk) and {v["inputs"] for v in service} == {"profile"}
    assert len({round(v["simulated"], 9) for v in service}) == 1 and all(v["measured"] > 0 for v in service)
    # the speedup over the block's OFF (paired per repeat): every other configuration of a block with an OFF, under
    # both inputs; measured as the mean of the per-repeat ratios
    speed = [v for v in val if v["metric"] == "speedup"]
    others = [r for r in record["runs"].values() if r["row"]["policy"] != "off"]
    assert len(speed) == 2 * len(others) and all(v["policy"] != "off" and v["simulated"] > 0 for v in speed)
    rows_by = {(r["block"], r["policy"], r["compute_opt"]): float(r["tokens_per_s"]) for r in rows}
    for v in speed:
        row = next(r for r in rows if r["policy"] == v["policy"] and r["experiment"] == v["experiment"]
                   and r["storage"] == v["storage"] and r["compute_opt"] == v["compute_opt"]
                   and int(r["lookahead"]) == int(v["lookahead"]) and int(r["m_max"]) == int(v["m_max"]))
        want = float(row["tokens_per_s"]) / rows_by[(row["block"], "off", row["compute_opt"])]
        assert v["measured"] == pytest.approx(want, rel=1e-3) and v["n_repeats"] == 1
    assert all(v == v for e in err.values() for v in (e["tokens_per_s"], e["hits"]))
    assert {v["n_repeats"] for v in val} == {1} and all(len(r["repeats"]) == 1 for r in record["runs"].values())
    # the run inputs are each repeat's own: the compute of its layers and, off the emulated devices, its transfers
    for run in record["runs"].values():
        (tm,) = run["timings"]
        assert len(tm["compute"]["moe_s"]) == spec.n_layers and all(t > 0 for t in tm["compute"]["moe_s"])
        resident = run["row"]["policy"] == "resident"
        assert (tm["n_transfers"] == 0) == resident and (resident or tm["transfer_ms"] > 0)
    assert tm["wake_ms"] >= 0 and tm["start_ms"] >= 0
    # replayed with its own inputs, OFF's counters are the runtime's (the same routing through the same cache)
    off = {v["metric"]: v for v in val if v["inputs"] == "run" and v["policy"] == "off"
           and v["experiment"] == "main"}
    assert off["misses"]["rel_error"] == 0 and off["hits"]["rel_error"] == 0


def test_budget_experiment_runs_the_dp_and_ewma_rules_and_the_simulator_replays_them(tmp_path: Path) -> None:
    """device.extra_rules on a tiny model: profile-window writes the DP rule's per-layer budgets (the per-layer
    window rule's total or less, each within the sweep's range); the budget experiment decodes SpecPrefetch at them,
    at the simulated rule's budget and with the online EWMA rule (runs.csv: budget_rule, and the mean budget it
    chose), all with the plain model's tokens; the simulator replays the EWMA run with the same rule."""
    import csv

    from specprefetch.config import section_defaults
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.measurement.bench import bench_runtime
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness
    from specprefetch.runtime.measurement.window import profile_window
    from specprefetch.runtime.simulation.budget_model import budget_curves
    from specprefetch.runtime.simulation.simrun import validate_simulator

    model = tiny_deepseek()
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec))
    s = section_defaults("device", {"n_prompts": 1, "max_new_tokens": 6, "repeats": 1, "io_workers": 2,
                                 "storages": ["nvme_cold"], "slow_storage": "nvme_cold", "experiments": ["budget"],
                                 "extra_rules": ["dp", "ewma", "simulated"], "sweep_m_max": [1, 2, 4],
                                 "window": {"n_prompts": 1, "demand_m": [2, 4], "transfer_samples": 4},
                                 "cache": {"capacity_experts": 8}})
    prompts = [Prompt("p0", {"input_ids": torch.randint(0, VOCAB, (1, 6)), "attention_mask": torch.ones(1, 6).long()})]
    providers = provider_factories({}, spec, "cpu")
    adapter = random_adapter(spec)
    providers["specprefetch"] = lambda: PredictorPriority(adapter)
    h = Harness(model, spec, store, s, prompts, providers)
    try:
        prof = profile_window(h, "tiny", "test-cpu", tmp_path / "window",
                              budget_model=lambda p, r: budget_curves(p, r, s))
        rows = bench_runtime(h, prof, "tiny", "test-cpu", tmp_path / "runs.csv", routing_out=tmp_path / "r.st")
    finally:
        h.close()
    dp = prof["m_max_dp_per_layer"]["nvme_cold"]
    assert len(dp) == spec.n_layers - 1 and all(1 <= m <= 4 for m in dp)
    assert sum(dp) <= sum(prof["m_max_per_layer"]["nvme_cold"]) and "dynamic programming" in prof["m_max_dp_rule"]
    with open(tmp_path / "runs.csv") as f:
        got = {(r["policy"], r["budget_rule"], r["layer_m_max"]): r for r in csv.DictReader(f)}
    assert len(got) == len(rows)
    by_rule = {rule: r for (pol, rule, _), r in got.items() if pol == "specprefetch"}
    ewma, d, sim = by_rule["ewma"], by_rule["dp"], by_rule["simulated"]
    assert int(sim["m_max"]) == prof["m_max_simulated_per_storage"]["nvme_cold"] and sim["tokens_match"] == "true"
    assert 1 <= float(ewma["m_max_mean"]) <= spec.n_experts and ewma["tokens_match"] == "true"
    m = prof["m_max_per_storage"]["nvme_cold"]
    assert int(ewma["m_max"]) == m  # the seed's budget
    assert float(got[("specprefetch", "", "")]["m_max_mean"]) == m  # a fixed budget: the budget, every step
    # the DP row: its per-layer budgets (none where they are the one budget: then it is that run, under its name)
    assert d["layer_m_max"] == ("/".join(map(str, dp)) if any(x != m for x in dp) else "")
    assert d["tokens_match"] == "true" and float(d["m_max_mean"]) == pytest.approx(sum(dp) / len(dp))
    assert got[("off", "", "")]["m_max_mean"] in ("", "nan")
    from specprefetch.contracts import ROUTING_FORMAT, load_tensor_tree

    record = load_tensor_tree(tmp_path / "r.st", ROUTING_FORMAT, "routing record")
    val = validate_simulator(record, prof, s)
    assert {"", "ewma"} <= {v["budget_rule"] for v in val if v["policy"] == "specprefetch"}
    assert all(v["simulated"] > 0 for v in val if v["metric"] == "tokens_per_s")


def test_widest_gain_ci_is_the_tables_ci_of_every_policy_gain_in_the_block() -> None:
    """The adaptive-repeats criterion: the widest paired-bootstrap half-width over every configuration but
    all-resident against every OFF of the block, with the pair it belongs to."""
    from specprefetch.metrics import bootstrap_ci
    from specprefetch.runtime.measurement.bench import RunConfig, widest_gain_ci

    off, spec, fate, res = (RunConfig("main", p, "nvme_cold", 4) for p in ("off", "specprefetch", "fate", "resident"))
    tps = {off.signature: [10.0, 11.0, 9.0, 10.0], spec.signature: [13.0, 15.0, 11.0, 14.0],
           fate.signature: [13.0, 14.3, 11.7, 13.0], res.signature: [30.0, 45.0, 20.0, 33.0]}
    width, what = widest_gain_ci([off, spec, fate, res], tps)
    gains = [(v / b - 1) * 100 for v, b in zip(tps[spec.signature], tps[off.signature])]
    assert width == pytest.approx(bootstrap_ci(gains).half_width) and width > 1.0
    assert what == "specprefetch M=4 vs off"  # FATE's gain is a constant +30 %: half-width 0; resident is skipped
    assert widest_gain_ci([spec, fate], tps) == (0.0, "")  # no OFF in the block: no gain to measure
    cold = RunConfig("component", "off", "nvme_cold", 0, compute_opt=False)  # Figure 6's reference is an OFF too
    tps[cold.signature] = [9.0, 9.0, 9.0, 9.0]
    assert widest_gain_ci([cold, fate], tps)[1] == "fate M=4 vs off (no compute opt)"


def test_blocks_are_measured_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block's repeat r before any block's repeat r + 1, blocks in a seeded random order per round; with
    adaptive repeats only the blocks whose gains are still imprecise go on."""
    from types import SimpleNamespace

    from specprefetch.runtime.measurement import bench
    from specprefetch.runtime.measurement.bench import Block, RunConfig

    def block(name: str) -> Block:
        cfgs = (RunConfig("main", "off", name, 0), RunConfig("main", "specprefetch", name, 4))
        return Block(name, name, cfgs, ("main",))

    noisy = {"nvme_cold": 0.0, "ufs": 5.0, "slow_ufs": 0.0}  # ufs's gain moves by 5 % a repeat: imprecise
    blocks = [block(st) for st in noisy]
    calls: list[tuple[str, int]] = []

    def measure(harness: Any, configs: dict[int, RunConfig], lockstep: bool, seed: str,
                online: Any = None) -> dict[int, Any]:
        _, name, r = seed.split("/")
        calls.append((name, int(r)))
        return {pos: (c, int(r)) for pos, c in configs.items()}

    rows: dict[Any, dict[str, float]] = {}

    def add(name: str, r: int, pos: int, cfg: RunConfig, res: Any) -> None:
        wobble = noisy[name] * (r % 2) if cfg.policy != "off" else 0.0
        rows[(name, r, cfg.signature)] = {"tokens_per_s": 10.0 + (2.0 + wobble if cfg.policy != "off" else 0.0)}

    monkeypatch.setattr(bench, "measure_block", measure)
    rec = SimpleNamespace(add=add, rows=rows, n_runs=0)
    harness = SimpleNamespace(settings={"repeats": 2, "max_repeats": 4, "target_ci_pp": 1.0, "interleave": "token"})
    n = bench._measure_rounds(harness, blocks, rec, seed=3)
    assert n == {"nvme_cold": 2, "ufs": 4, "slow_ufs": 2}
    rounds = [r for _, r in calls]
    assert rounds == sorted(rounds)  # round by round
    assert sorted(calls[:3]) == [("nvme_cold", 0), ("slow_ufs", 0), ("ufs", 0)]
    assert calls[6:] == [("ufs", 2), ("ufs", 3)]
    for r in (0, 1):  # each round's block order is the seeded one of that round
        assert [b.name for b in bench.round_order(blocks, 3, r)] == [b for b, _ in calls[3 * r: 3 * r + 3]]
    assert len({tuple(b.name for b in bench.round_order(blocks, 3, r)) for r in range(8)}) > 1  # not one order


@pytest.mark.parametrize(("target", "measured"), [(1e-9, 3), (1e9, 2)])
def test_adaptive_repeats_go_on_until_the_gains_are_precise(tmp_path: Path, target: float, measured: int) -> None:
    """With ``max_repeats`` a block measures ``repeats`` repeats, then one more at a time while some gain's CI is
    wider than ``target_ci_pp``, up to ``max_repeats``; every configuration keeps its pairs."""
    from specprefetch.config import section_defaults
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.measurement.bench import bench_runtime
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness

    model = tiny_deepseek()
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec))
    s = section_defaults("device", {"n_prompts": 1, "max_new_tokens": 3, "repeats": 2, "max_repeats": 3,
                                 "target_ci_pp": target, "io_workers": 2, "storages": ["nvme_cold"],
                                 "experiments": ["main"], "main_policies": ["off", "pred0", "resident"], "m_max": 2,
                                 "cache": {"capacity_experts": 8}})
    prompts = [Prompt("p0", {"input_ids": torch.randint(0, VOCAB, (1, 6)), "attention_mask": torch.ones(1, 6).long()})]
    providers = provider_factories({}, spec, "cpu")
    providers["specprefetch"] = lambda: PredictorPriority(random_adapter(spec))
    h = Harness(model, spec, store, s, prompts, providers)
    prof = {"m_max": 2, "m_max_per_storage": {"nvme_cold": 2}}
    try:
        rows = bench_runtime(h, prof, "tiny", "test-cpu", tmp_path / "runs.csv")
    finally:
        h.close()
    assert sorted((r["policy"], r["repeat"]) for r in rows) == sorted(
        (p, r) for p in ("off", "pred0", "resident") for r in range(measured))


def test_blocks_measure_each_configuration_once_per_block() -> None:
    """Without a size limit a storage is one block that measures every distinct configuration its experiments run
    once, as the first experiment that lists it; with ``max_block_runs`` whole experiments are packed into blocks of
    at most that many configurations, each block with its own OFF; per-layer budgets that differ from M_max add one
    configuration."""
    from specprefetch.config import REPO_ROOT, load_config
    from specprefetch.runtime.core.settings import device_settings
    from specprefetch.runtime.measurement.bench import plan_experiments, storage_blocks

    s = device_settings(load_config(REPO_ROOT / "config" / "config.yaml"))
    plan = plan_experiments(s, 5, s["experiments"])
    blocks = {b.name: b for b in storage_blocks(plan)}
    assert list(blocks) == ["nvme_cold", "slow_ufs", "nvme", "ufs"]
    assert {b.storage for b in blocks.values()} == set(blocks)
    got = {st: sorted((c.experiment, c.policy, c.budget, c.compute_opt) for c in b.configs)
           for st, b in blocks.items()}
    main = [("main", p, 0 if p in ("off", "resident") else 5, True) for p in s["main_policies"]]
    sweep = [("sweep", "specprefetch", m, True) for m in s["sweep_m_max"] if m != 5]
    component = [("component", "off", 0, False), ("component", "specprefetch", 5, False)]
    assert got["nvme_cold"] == sorted(main + sweep + component)
    assert blocks["nvme_cold"].experiments == tuple(s["experiments"])
    assert got["slow_ufs"] == sorted(("matched", p, 0 if p == "off" else 5, True) for p in s["matched_policies"])
    assert got["nvme"] == got["ufs"] == [("storage", "off", 0, True), ("storage", "specprefetch", 5, True)]
    for st, b in blocks.items():  # every experiment's configuration on st is in its block, once
        sigs = [c.signature for c in b.configs]
        assert len(sigs) == len(set(sigs))
        assert {c.signature for v in plan.values() for c in v if c.storage == st} == set(sigs)
    assert len(plan["budget"]) == 2 * len(set(s["storages"]) | {"nvme_cold", "slow_ufs"})
    # at most 6 per block: the cold disk's experiments in three blocks, each pairing with its own OFF
    small = storage_blocks(plan, 6)
    assert [(b.name, b.experiments, len(b.configs)) for b in small] == [
        ("nvme_cold", ("main", "matched", "storage", "budget"), 6), ("nvme_cold#2", ("sweep",), 7),
        ("nvme_cold#3", ("component",), 4), ("slow_ufs", ("matched", "storage", "budget"), 4),
        ("nvme", ("storage", "budget"), 2), ("ufs", ("storage", "budget"), 2)]
    for b in small:
        assert ("off", b.storage, 0, True, (), 1, "", 1) in {c.signature for c in b.configs}
        for exp in b.experiments:  # every configuration of an experiment is in the one block that measures it
            assert {c.signature for c in plan[exp] if c.storage == b.storage} <= {c.signature for c in b.configs}
    assert {(e, b.storage) for b in small for e in b.experiments} == {
        (c.experiment, c.storage) for v in plan.values() for c in v}
    # an experiment larger than the limit is a block of its own, never split (the sweep: OFF, 1, 2, 4, 5, 8, 16)
    assert [len(b.configs) for b in storage_blocks(plan, 2) if b.storage == "nvme_cold"] == [6, 7, 4]
    # per-layer budgets that differ from M_max on one storage: one more configuration there, in the budget plan
    n = 5
    layers = {st: (5,) * n for st in ("nvme_cold", "slow_ufs", "nvme")} | {"ufs": (5, 6, 6, 4, 5)}
    plan = plan_experiments(s, 5, s["experiments"], layers)
    blocks = {b.name: b for b in storage_blocks(plan)}
    assert [(c.experiment, c.policy, c.layers) for c in blocks["ufs"].configs] == [
        ("storage", "off", ()), ("storage", "specprefetch", ()), ("budget", "specprefetch", (5, 6, 6, 4, 5))]
    assert len(blocks["nvme"].configs) == 2 and blocks["ufs"].configs[2].key.endswith("|L6/6/4/5")


# ------------------------------------------------------------------------------------------ lm-eval
def test_lm_eval_scores_equal_plain_model(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """lm-eval through the offloaded runtime: same generations and scores as the plain model, every policy."""
    from types import SimpleNamespace

    from specprefetch.config import section_defaults
    from specprefetch.data.lm_eval_tasks import write_lm_eval_task
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.lm_eval_model import evaluate_offloaded
    from tests.conftest import write_tiny_workload

    wdir = write_tiny_workload(tmp_path / "workloads" / "gsm8k", 3, 32, seed=4, split="test", benchmark="gsm8k")
    write_lm_eval_task(wdir, "tiny_gsm8k")
    model = tiny_qwen()
    model.resize_token_embeddings(len(tiny_tokenizer))
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec))
    cfg = {"workloads": {"gsm8k": {"generator": "gsm8k_synth", "lm_eval_task": "tiny_gsm8k"}}}
    s = section_defaults("device", {"accuracy": {"policies": ["off", "specprefetch", "naive", "resident"], "limit": 2,
                                              "max_gen_toks": 6}, "m_max": 3, "cache": {"capacity_experts": 8}})
    providers = provider_factories({}, spec, "cpu")
    adapter = random_adapter(spec)
    providers["specprefetch"] = lambda: PredictorPriority(adapter)
    bundle = SimpleNamespace(model=model, tokenizer=tiny_tokenizer, routing=spec)
    rows = evaluate_offloaded(cfg, s, "tiny", bundle, store, providers, tmp_path / "workloads", tmp_path / "acc.csv")
    assert {r["policy"] for r in rows} == {"off", "specprefetch", "naive", "resident"}
    for r in rows:
        assert r["equal_outputs"] and r["equal_score"] and r["n_samples"] == 2 and r["moe_layer_calls"] > 0
    assert any(r["expert_loads"] > 0 for r in rows if r["policy"] == "off")


# ------------------------------------------------------------------------------------------ priorities, storage model
def test_runtime_priorities_match_the_predictor(setup: dict[str, Any]) -> None:
    """Per-layer runtime priorities rank experts exactly as the predictors package's batch priorities do."""
    spec = setup["spec"]
    torch.manual_seed(3)
    x = [torch.randn(5, spec.hidden_size) for _ in range(spec.n_layers)]
    batch = {"x": x}
    for pred in (random_adapter(spec), fate_from_model(spec)):
        prov = PredictorPriority(pred)
        ref = pred.priorities(batch, "batch")
        for l in range(spec.n_layers - 1):
            assert torch.allclose(prov.scores(l, x[l]), ref[l], atol=1e-5)
            one = pred.priorities({"x": [t[:1] for t in x]}, "batch")[l]
            assert select_prefetch(prov.scores(l, x[l][:1]), set(), 4) == select_prefetch(one, set(), 4)
        assert prov.scores(spec.n_layers - 1, x[-1]) is None


def test_bandwidth_model_and_profiles() -> None:
    """Emulated devices charge the real payload at the datasheet bandwidth; data phases are serialised, latencies
    overlap; a demand request overtakes the prefetches that have not started their data phase."""
    from specprefetch.runtime.core.storage import BandwidthModel, StorageError

    p = make_profile("slow_ufs", _device(emulation="bandwidth"), 1_000_000)
    assert p.charged_bytes == 1_000_000
    data, lat = 1e6 / 850e6, 0.20e-3
    assert p.transfer_s() == pytest.approx(lat + data)
    bw = BandwidthModel(p)
    first, second = bw.schedule(10.0), bw.schedule(10.0)
    assert first == pytest.approx(10.0 + data + lat)
    assert second == pytest.approx(10.0 + 2 * data + lat)  # data serialised, latency overlapped
    bw.reset()
    a, b = bw.reserve(0.0), bw.reserve(0.0)                  # prefetches: a transferring, b waiting for bandwidth
    d = bw.reserve(0.5 * data, demand=True)                  # a demand load arrives while a transfers
    assert a.end == pytest.approx(data)                      # under way: not interrupted
    assert d.start == pytest.approx(data) and b.start == pytest.approx(2 * data)  # the demand goes first
    e = bw.reserve(0.6 * data, demand=True)                  # a second demand queues behind the first, before b
    assert e.start == pytest.approx(2 * data) and b.start == pytest.approx(3 * data)
    with pytest.raises(StorageError, match="device.storage_profiles.ufs"):
        make_profile("ufs", {**_device(), "storage_profiles": {"ufs": {"bandwidth_mbps": 0, "latency_ms": 1}}})
    with pytest.raises(StorageError, match="unknown storage profile"):
        make_profile("floppy", _device())


def test_emulated_load_reads_its_bytes_and_is_on_time(setup: dict[str, Any]) -> None:
    """An emulated load delivers the record (checked against its sha256) and lasts at least its modelled time."""
    import time

    store = setup["store"]
    prof = make_profile("sdcard", _device(emulation="bandwidth"), store.layout.payload_bytes)
    reader = ExpertReader(store, prof, verify=True)
    try:
        reader.prepare_run()
        buf = torch.empty(store.record_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        reader.read(0, 1, buf, demand=True)
        assert time.perf_counter() - t0 >= prof.transfer_s()
        assert bytes(buf.numpy()) == next(rec for e, rec in store.read_all(0) if e == 1)
    finally:
        reader.close()


def test_cold_reads_bypass_the_page_cache_or_fall_back(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """nvme_cold reads with O_DIRECT into aligned buffers where the file system allows it, else evicts pages
    around each read with a logged warning; either way the bytes are the record's."""
    from specprefetch.runtime.core.storage import host_buffer

    store = setup["store"]
    prof = make_profile("nvme_cold", _device(), store.layout.payload_bytes)
    reader = ExpertReader(store, prof, verify=True)
    try:
        assert reader.cold_read_mode in ("direct", "fadvise")
        reader.read(0, 2, host_buffer(store.record_bytes))
        reader.read(0, 3, torch.empty(store.record_bytes + 1, dtype=torch.uint8)[1:])  # unaligned: buffered read
    finally:
        reader.close()
    real_open = os.open

    def no_direct(path: Any, flags: int, *a: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level("WARNING"):
        reader = ExpertReader(store, prof, verify=True)
    try:
        assert reader.cold_read_mode == "fadvise" and "O_DIRECT refused" in caplog.text
        reader.read(0, 2, host_buffer(store.record_bytes))
    finally:
        reader.close()


def test_direct_reads_land_in_shared_staging_buffers(setup: dict[str, Any]) -> None:
    """A direct (O_DIRECT) load goes through the reader's staging buffers, then into the slot: the buffers are
    page-aligned and reused by every load and every engine (a new one only while all are taken), so no run reads into
    memory of its own; the slot holds the record's bytes, and transfers through an engine too."""
    from specprefetch.runtime.core.cache import ExpertCache, SlotPool
    from specprefetch.runtime.core.transfer import TransferEngine

    store = setup["store"]
    reader = ExpertReader(store, make_profile("nvme_cold", _device(), store.layout.payload_bytes), verify=True)
    reader.cold_read_mode = "direct"  # where the file system refuses O_DIRECT the reads are buffered, same path
    records = dict(store.read_all(0))
    try:
        with reader.staging() as a, reader.staging() as b:
            assert a is not b and a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
        made = {a.data_ptr(), b.data_ptr()}
        slot = torch.empty(store.record_bytes + 1, dtype=torch.uint8)[1:]  # any memory, even unaligned
        for e in (2, 3):
            reader.load(0, e, slot)
            assert bytes(slot.numpy()) == records[e]
        for _ in range(2):  # two runs' engines, one after another
            cache = ExpertCache(4)
            pool = SlotPool(4, store.layout, torch.device("cpu"))
            eng = TransferEngine(reader, cache, pool, n_workers=2, retries=0)
            try:
                for e in range(4):
                    with cache.lock:
                        cache.reserve((0, e))
                        eng.submit((0, e), "prefetch", 0)
                eng.drain()
                for e in range(4):
                    assert bytes(pool.record(cache.slot((0, e))).numpy()) == records[e]
            finally:
                eng.shutdown()
        assert {buf.data_ptr() for buf in reader._staging} >= made and len(reader._staging) <= 3
    finally:
        reader.close()


def _engine(setup: dict[str, Any], storage: str, workers: int, **device: Any) -> tuple[Any, Any, Any]:
    """(reader, cache of 4 experts, TransferEngine without retries) over the fixture's store on ``storage``."""
    from specprefetch.runtime.core.cache import ExpertCache, SlotPool
    from specprefetch.runtime.core.transfer import TransferEngine

    store = setup["store"]
    reader = ExpertReader(store, make_profile(storage, _device(**device), store.layout.payload_bytes))
    cache = ExpertCache(4)
    return reader, cache, TransferEngine(reader, cache, SlotPool(4, store.layout, "cpu"), n_workers=workers,
                                         retries=0)


def test_prefetches_wait_while_a_demand_load_is_outstanding(setup: dict[str, Any]) -> None:
    """No prefetch starts while a demand load is queued or running (it yields to the executing layer)."""
    reader, cache, eng = _engine(setup, "ram", 2)
    try:
        with cache.lock:
            cache.reserve((0, 0))
            demand = eng.submit((0, 0), "demand", 0)
            cache.reserve((1, 0))
            pre = eng.submit((1, 0), "prefetch", 0)
        import time

        time.sleep(0.05)
        assert pre.state == "pending"              # held back: the demand load is outstanding
        assert eng.steal((0, 0)) is demand
        eng.execute(demand)
        eng.wait(pre)
        assert pre.state == "done" and pre.t_start >= demand.t_end
    finally:
        eng.shutdown()
        reader.close()


def test_a_waited_transfer_records_when_its_waiter_woke(setup: dict[str, Any]) -> None:
    """TransferEngine.wait stamps ``t_woken`` on a load a worker finished while the caller blocked on it (the
    hand-off back to the compute thread: window.hand_offs, the simulator's wake_s); a load nobody waited for, or one
    the caller performed itself, has none."""
    # an SD card's 1 ms per read (emulated): the worker is still reading when the caller waits
    reader, cache, eng = _engine(setup, "sdcard", 1, cold_each_read=False, emulation="bandwidth")
    try:
        with cache.lock:
            cache.reserve((1, 0))
            waited = eng.submit((1, 0), "prefetch", 0)
        eng.wait(waited)
        assert waited.state == "done" and waited.t_woken >= waited.t_end > waited.t_start > 0
        with cache.lock:
            cache.reserve((1, 1))
            late = eng.submit((1, 1), "prefetch", 0)
            cache.reserve((0, 0))
            own = eng.submit((0, 0), "demand", 0)
        while not late.finished:
            eng.wait_any(0.1)
        eng.wait(late)  # finished before the call: nothing was handed back
        if eng.steal((0, 0)) is own:
            eng.execute(own)
        eng.wait(own)
        assert late.t_woken == 0.0 and (own.inline and own.t_woken == 0.0 or own.t_woken >= own.t_end)
    finally:
        eng.shutdown()
        reader.close()


def test_a_worker_that_slept_records_its_wake_up(setup: dict[str, Any]) -> None:
    """A load offered to sleeping workers (a prefetch's submission; under demand-first, the end of the demand load that
    held it back) records when: ``t_start - t_offered`` is the wake-up of the worker that took it (window.hand_offs'
    ``start_ms``, the simulator's start_s). A load a busy worker took next, or the caller's own, is no such hand-off."""
    reader, cache, eng = _engine(setup, "sdcard", 1, cold_each_read=False, emulation="bandwidth")
    try:
        import time

        time.sleep(0.02)  # the worker is asleep
        with cache.lock:
            cache.reserve((1, 0))
            first = eng.submit((1, 0), "prefetch", 0)
            cache.reserve((1, 1))
            second = eng.submit((1, 1), "prefetch", 0)  # queued behind: the busy worker takes it next
        eng.wait(second)
        assert first.woke and first.t_start >= first.t_offered == first.t_submit > 0
        assert not second.woke and second.t_offered == second.t_submit
        with cache.lock:
            cache.reserve((0, 0))
            demand = eng.submit((0, 0), "demand", 0)
            cache.reserve((1, 2))
            held = eng.submit((1, 2), "prefetch", 0)  # held back while the demand load is outstanding
        offered = held.t_offered
        assert eng.steal((0, 0)) is demand
        eng.execute(demand)
        eng.wait(held)
        assert not demand.woke and held.t_offered == demand.t_end > offered  # offered again when it ended
        assert held.woke and held.t_start >= held.t_offered
    finally:
        eng.shutdown()
        reader.close()


def test_per_model_experiments() -> None:
    """device.model_experiments narrows one model's benchmark experiments; a bad entry names its key."""
    from specprefetch.config import REPO_ROOT, load_config
    from specprefetch.io import SpecPrefetchError
    from specprefetch.runtime.core.settings import device_settings, experiments_for

    cfg = load_config(REPO_ROOT / "config" / "config.yaml")
    d = device_settings(cfg)
    assert experiments_for(d, "tiny-qwen3-vl-moe") == ["main"]
    assert experiments_for(d, "tiny-deepseek-vl2") == d["experiments"] == ["main", "matched", "sweep", "storage",
                                                                            "component", "budget"]
    bad = {**cfg, "device": {**cfg["device"], "model_experiments": {"tiny-deepseek-vl2": ["nope"]}}}
    with pytest.raises(SpecPrefetchError, match=r"device.model_experiments.tiny-deepseek-vl2': 'nope'"):
        device_settings(bad)


def test_missing_or_foreign_window_profile_is_a_clear_error(tmp_path: Path) -> None:
    """validate-simulator / bench-runtime name the profile.json that is missing or belongs to another model."""
    import subprocess
    import sys

    from specprefetch.config import REPO_ROOT

    def validate(window: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specprefetch", "validate-simulator", "--config",
                               str(REPO_ROOT / "config" / "config.yaml"), "--model", "tiny-deepseek-vl2",
                               "--window", str(window), "--routing", str(tmp_path / "r.pt"),
                               "--out", str(tmp_path / "v.csv")], capture_output=True, text=True)

    res = validate(tmp_path / "nowhere")
    assert res.returncode != 0 and "nowhere/profile.json: cannot read the window profile" in res.stderr
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "profile.json").write_text(json.dumps({"model": "tiny-qwen3-vl-moe"}))
    res = validate(tmp_path / "w")
    assert res.returncode != 0 and "is for model 'tiny-qwen3-vl-moe', not 'tiny-deepseek-vl2'" in res.stderr
    assert not (tmp_path / "v.csv").exists()


def test_simulator_platforms_are_the_config_vocabulary() -> None:
    """The platforms a config may name (the schema's enum) are exactly the simulator's platform table."""
    import yaml

    from specprefetch.config import REPO_ROOT, section_defaults
    from specprefetch.runtime.simulation.platforms import PLATFORMS

    schema = yaml.safe_load((REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    enum = schema["$defs"]["device"]["properties"]["simulator"]["properties"]["platforms"]["items"]["enum"]
    assert enum == list(PLATFORMS) == section_defaults("device")["simulator"]["platforms"]


def test_benchmark_blocks_run_in_a_seeded_random_order() -> None:
    """No configuration is always first in its block: each (storage, repeat) has its own, reproducible order."""
    from specprefetch.runtime.measurement.bench import RunConfig, block_order

    configs = [RunConfig("main", p, "nvme_cold", 4) for p in ("off", "pred0", "specprefetch", "naive", "fate")]
    orders = [block_order(configs, 7, "nvme_cold", r) for r in range(6)]
    assert all(sorted(o, key=configs.index) == configs for o in orders)  # a permutation, nothing lost
    assert len({o[0].policy for o in orders}) > 1 and len({tuple(o) for o in orders}) > 1
    assert block_order(configs, 7, "nvme_cold", 3) == orders[3]
    assert block_order(configs, 8, "nvme_cold", 3) != orders[3]


def test_control_path_benchmark_script_runs() -> None:
    """scripts/bench_control_path.py drives the runtime's own prediction phase (``LayerLoop.predict``): it must keep
    up with it."""
    import importlib.util

    from specprefetch.config import REPO_ROOT

    spec = importlib.util.spec_from_file_location("bench_control_path", REPO_ROOT / "scripts" / "bench_control_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.control_path_us(32, 16, 4, 4, reps=5)
    assert set(res) == {"matmul", "scores", "select", "control", "beyond matmul"}
    assert all(v[0] > 0 for k, v in res.items() if k != "beyond matmul")


def test_device_summary_script_reads_the_committed_runs(tmp_path: Path) -> None:
    """scripts/device_summary.py on the committed paper_tables/results: every measured main-comparison policy is a
    row, with its gain CI, and the spread table gives the repeats a 2 pp CI would need (at least those measured)."""
    import subprocess
    import sys

    from specprefetch.config import REPO_ROOT

    res = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "device_summary.py"),
                          str(REPO_ROOT / "paper_tables" / "results")], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "**tiny-deepseek-vl2, main, nvme_cold**" in out and "Run-to-run spread" in out
    main = out.split("**tiny-deepseek-vl2, main, nvme_cold**")[1].split("\n\n")[1]
    rows = {line.split("|")[1].strip(): line for line in main.splitlines() if line.startswith("| ")}
    assert {"off", "specprefetch", "fate", "naive", "pred0", "resident"} <= set(rows)
    assert "[" in rows["specprefetch"] and "%" in rows["specprefetch"]
    assert int(rows["off"].split("|")[6]) > int(rows["specprefetch"].split("|")[6]) > 0  # demand loads per run
    sweep = out.split("**tiny-deepseek-vl2, sweep, nvme_cold**")[1].split("\n\n")[1]
    budgets = [line.split("|")[2].strip() for line in sweep.splitlines() if line.startswith("| specprefetch")]
    assert len(budgets) >= 5 and "16" in budgets  # every swept budget is a row
    comp = out.split("**tiny-deepseek-vl2, component, nvme_cold**")[1].split("\n\n")[1]
    assert sum("compute_opt on" in line or "compute_opt off" in line for line in comp.splitlines()) == 4
    # OFF on cold NVMe is measured in the main, sweep and component blocks: one row, each block's mean and size
    across = out.split("**The same configuration in several blocks**")[1].split("\n\n")[1]
    off = next(line for line in across.splitlines() if "off nvme_cold" in line)
    assert off.count("runs a round") >= 3 and off.rstrip(" |").endswith("%"), off
    spread = out.split("Run-to-run spread")[1].split("**The same configuration")[0]  # the across-blocks table follows
    needs = [int(line.rstrip(" |").rsplit("|", 1)[1]) for line in spread.splitlines()
             if line.startswith("| tiny-")]
    assert needs and all(n >= 2 for n in needs)
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "device_summary.py"), str(tmp_path / "empty")],
                         capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "no device/runs.csv" in bad.stderr and "Traceback" not in bad.stderr


def test_collect_keeps_runs_that_differ_only_in_their_per_layer_budgets(tmp_path: Path) -> None:
    """The budget experiment's two SpecPrefetch runs share every key column but ``layer_m_max``: both are kept; a
    true duplicate is still refused with the line that repeats it."""
    from specprefetch.contracts import RUN_COLUMNS
    from specprefetch.io import SpecPrefetchError
    from specprefetch.runtime.measurement.bench import write_runs_csv
    from specprefetch.runtime.measurement.external import collect_device_benchmarks

    base = {c: "" for c in RUN_COLUMNS} | {
        "platform": "local-cpu", "model": "m", "experiment": "budget", "policy": "specprefetch", "storage": "ufs",
        "m_max": 6, "compute_opt": True, "repeat": 0, "tokens_per_s": 5.0, "ready_recall": 0.5, "n_tokens": 31,
        "hits": 1, "misses": 1, "prefetched": 1, "wasted": 0, "stall_ms": 1.0, "source": "measured"}
    rows = [base, {**base, "layer_m_max": "7/7/6/6"}]
    write_runs_csv(tmp_path / "a.csv", rows)
    got = collect_device_benchmarks([tmp_path / "a.csv"], [], tmp_path / "runs.csv")
    assert [r["layer_m_max"] for r in got] == ["", "7/7/6/6"]
    write_runs_csv(tmp_path / "b.csv", [*rows, rows[1]])
    with pytest.raises(SpecPrefetchError, match=r"b\.csv:4: the same run .* as .*b\.csv:3"):
        collect_device_benchmarks([tmp_path / "b.csv"], [], tmp_path / "runs2.csv")


def test_window_excludes_the_layers_own_stall() -> None:
    """W_l = t_exec(l+1) - t_pred(l) - stall_l: in an offloaded run the time layer l waits for its own demand loads
    (which hold the device) is no window for layer l+1's prefetches; a multi-token (prefill) step has none."""
    from specprefetch.runtime.measurement.window import per_layer_windows

    def ev(step: int, layer: int, t_exec: float, t_pred: float | None, stall: float, n: int = 1) -> LayerEvent:
        e = LayerEvent(step=step, layer=layer, n_tokens=n, t_exec=t_exec, required=[0], hits=0, inflight=0,
                       misses=1, ready_pairs=0)
        e.t_pred, e.stall_s = t_pred, stall
        return e

    events = [ev(1, 0, 0.000, 0.001, 0.002), ev(1, 1, 0.010, 0.011, 0.0), ev(1, 2, 0.015, None, 0.0),
              ev(0, 0, 0.0, 0.001, 0.0, n=5), ev(0, 1, 0.5, 0.6, 0.0, n=5)]
    w = per_layer_windows(events)
    assert set(w) == {(1, 0), (1, 1)}
    assert w[(1, 0)] == pytest.approx(10.0 - 1.0 - 2.0) and w[(1, 1)] == pytest.approx(4.0)


def test_service_transfer_time_is_busy_time_per_expert_and_the_budget_its_window_share() -> None:
    """The per-expert transfer time behind M_max is what one expert costs the storage in the runtime: per decoding
    step, the union of its transfers' intervals over their number (overlapping requests share the time, idle gaps
    do not count), the median over steps; prefill, failed and uncharged transfers are not counted. M_max =
    max(1, floor(W / t)), at most n."""
    from specprefetch.runtime.core.timeline import RunStats
    from specprefetch.runtime.core.transfer import Transfer
    from specprefetch.runtime.measurement.session import RunResult
    from specprefetch.runtime.measurement.window import derive_m_max, service_transfer_ms

    def tr(step: int, a: float, b: float, state: str = "done", charged: bool = True) -> Transfer:
        return Transfer((0, 0), "prefetch", step, 0, state=state, t_start=a, t_end=b, charged=charged)

    events = [LayerEvent(s, 0, n, 0.0, [0], 0, 0, 1, 0) for s, n in ((0, 6), (1, 1), (2, 1), (3, 1))]
    transfers = [tr(0, 0.0, 9.0),                                        # prefill: not decoding
                 tr(1, 1.000, 1.004), tr(1, 1.001, 1.005), tr(1, 1.010, 1.012),  # busy 5 + 2 ms, 3 served
                 tr(2, 2.000, 2.001), tr(2, 2.000, 2.001),              # 1 ms, 2 served
                 tr(2, 2.0, 2.9, state="failed"), tr(2, 2.0, 2.9, charged=False),
                 tr(3, 3.000, 3.006)]                                   # 6 ms, 1 served
    res = RunResult("specprefetch", "nvme_cold", 6, True, 8, RunStats(), [], events, transfers)
    assert service_transfer_ms(res) == pytest.approx(7.0 / 3)  # median of 7/3, 1/2 and 6 ms
    assert math.isnan(service_transfer_ms(RunResult("off", "ram", 0, True, 8, RunStats(), [], events, [])))
    assert derive_m_max(3.6, 7.0 / 3, 64) == 1 and derive_m_max(3.6, 0.5, 64) == 7 and derive_m_max(3.6, 0.01, 6) == 6
    assert derive_m_max(0.2, 0.5, 64) == 1


# ------------------------------------------------------------------------------------------ lockstep runs
def test_own_time_removes_the_pauses_before_each_timestamp() -> None:
    from specprefetch.runtime.core.transfer import Transfer
    from specprefetch.runtime.measurement.decode import Generation
    from specprefetch.runtime.measurement.session import RunResult, own_time

    ev = LayerEvent(1, 0, 1, 12.0, [0], 1, 0, 0, 1)
    ev.t_compute, ev.t_ready, ev.t_done, ev.t_pred = 16.0, 16.0, 21.0, None
    tr = Transfer((0, 1), "prefetch", 1, 0, t_submit=5.0, t_start=23.0, t_end=0.0)
    waited = Transfer((0, 2), "demand", 1, 1, t_submit=16.0, t_start=16.5, t_end=23.0, t_woken=23.5,
                      t_offered=16.2)
    res = RunResult("off", "ram", 0, True, 4, summarize([], 1), [Generation("p", [1, 2], [5.0, 23.0])], [ev],
                    [tr, waited])
    own_time(res, [(10.0, 15.0), (20.0, 22.0)])
    # before any pause: as is; inside one: its start; after: minus every pause before it; 0 (unset) stays 0
    assert res.generations[0].times == [5.0, 16.0]
    assert (ev.t_exec, ev.t_compute, ev.t_done, ev.t_pred) == (10.0, 11.0, 15.0, None)
    assert (tr.t_submit, tr.t_start, tr.t_end, tr.t_woken) == (5.0, 16.0, 0.0, 0.0)
    assert waited.t_woken - waited.t_end == 0.5  # the hand-offs keep their length on the run's own clock
    assert waited.t_start - waited.t_offered == pytest.approx(0.3)


def _lockstep_harness(s: dict[str, Any], providers: dict[str, Any] | None = None) -> Any:
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness

    settings = _device(n_prompts=1, max_new_tokens=NEW, io_workers=2, cache={"capacity_experts": 2 * s["spec"].top_k})
    adapter = random_adapter(s["spec"])
    provs = providers or {"specprefetch": lambda: PredictorPriority(adapter)}
    prompt = Prompt("p0", {"input_ids": s["ids"], "attention_mask": torch.ones_like(s["ids"])})
    return Harness(s["model"], s["spec"], s["store"], settings, [prompt], provs)


def test_lockstep_runs_decode_the_plain_tokens_each_on_its_own_clock(setup: dict[str, Any]) -> None:
    """Runs decoded token by token in turn: each reproduces the plain model's tokens, OFF's counters are those of
    a run alone (its cache sees the same routing), and each run's timestamps are its own time (monotone, and
    together no longer than the lockstep took)."""
    import threading
    import time

    h = _lockstep_harness(setup)
    try:
        plain = [g.new_ids for g in h.plain_generations()]
        alone = h.run("off", "nvme")
        runs = [{"policy": p, "storage": st, "m_max": 2, "record": True}
                for p, st in (("off", "nvme"), ("specprefetch", "nvme"), ("resident", "ram"), ("off", "ram"))]
        n_threads = threading.active_count()
        t0 = time.perf_counter()
        got = h.run_lockstep(runs, seed="t")
        wall = time.perf_counter() - t0
        assert threading.active_count() == n_threads  # every lane and I/O thread has ended
    finally:
        h.close()
    assert [r.policy for r in got] == ["off", "specprefetch", "resident", "off"]
    assert all(r.tokens() == plain for r in got)
    assert (got[0].stats.hits, got[0].stats.misses) == (alone.stats.hits, alone.stats.misses)
    assert got[2].stats.ready_recall == 1.0 and got[1].stats.prefetched > 0
    assert sum(r.decode_s for r in got) <= wall
    for r in got:
        t = [ev.t_exec for ev in r.events]
        assert t == sorted(t) and all(ev.t_done >= ev.t_exec for ev in r.events)
        times = r.generations[0].times
        assert times == sorted(times) and r.decode_s > 0


def test_lockstep_run_failure_is_raised_and_stops_the_others(setup: dict[str, Any]) -> None:
    import threading

    class Failing(PredictorPriority):
        calls = 0

        def scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
            Failing.calls += 1
            if Failing.calls > 5:
                raise RuntimeError("predictor failed")
            return super().scores(layer, hidden)

    adapter = random_adapter(setup["spec"])
    h = _lockstep_harness(setup, {"specprefetch": lambda: Failing(adapter)})
    n_threads = threading.active_count()
    try:
        with pytest.raises(RuntimeError, match="predictor failed"):
            h.run_lockstep([{"policy": "off", "storage": "ram"}, {"policy": "specprefetch", "storage": "ram",
                                                                  "m_max": 2}], seed="t")
        assert threading.active_count() == n_threads
        # the model is usable again: its experts are unbound, a plain run decodes
        assert h.run("off", "ram").tokens() == [g.new_ids for g in h.plain_generations()]
    finally:
        h.close()


@pytest.mark.parametrize("lockstep", [True, False])
def test_measure_block_runs_every_configuration_by_position(setup: dict[str, Any], lockstep: bool) -> None:
    from specprefetch.runtime.measurement.bench import RunConfig, measure_block

    h = _lockstep_harness(setup)
    try:
        configs = {0: RunConfig("main", "specprefetch", "nvme", 2), 2: RunConfig("main", "off", "nvme", 2)}
        got = measure_block(h, configs, lockstep, "t")
        plain = [g.new_ids for g in h.plain_generations()]
    finally:
        h.close()
    assert sorted(got) == [0, 2] and got[0].policy == "specprefetch" and got[2].policy == "off"
    assert got[2].m_max == 0 and all(r.tokens() == plain for r in got.values())


def test_prefill_loads_on_demand_only(setup: dict[str, Any]) -> None:
    """A prefill (many tokens) never prefetches, whatever the policy, so it leaves every policy the same cache;
    decoding steps do prefetch."""
    _, rt = run_policy(setup, "specprefetch", m_max=4, record=True)
    prefill_steps = {ev.step for ev in rt.events if ev.n_tokens > 1}
    assert prefill_steps == {0}
    assert not [tr for tr in rt.engine.log if tr.step == 0 and tr.kind == "prefetch"]
    assert not [ev for ev in rt.events if ev.step == 0 and (ev.issued or ev.t_pred is not None)]
    assert any(tr.kind == "prefetch" for tr in rt.engine.log)


def test_decoding_from_an_adopted_prefill(setup: dict[str, Any]) -> None:
    """A runtime that adopts another's prefill decodes the plain tokens from it (first token's time: when decoding
    resumes); every expert stays resident where all are; a cache of another capacity cannot adopt; a prefill does
    not start another prompt."""
    from specprefetch.runtime.measurement.decode import Prompt, greedy_generate, prefill

    h = _lockstep_harness(setup)
    prompt = h.prompts[0]
    rts = []

    def runtime(policy: str, **kw: Any) -> OffloadedRuntime:
        rt = h.runtime(policy, "ram", m_max=2, record=True, **kw).install()
        rt.reset_run()
        rts.append(rt)
        return rt

    try:
        src = runtime("off")
        src.new_sequence()
        start = prefill(h.model, prompt, h.tokenizer)
        adopted, resident = runtime("specprefetch"), runtime("resident")
        adopted.adopt(src)
        resident.adopt(src)
        with pytest.raises(OffloadError, match="same cache capacity"):
            runtime("off", capacity=h.capacity + 1).adopt(src)
        with pytest.raises(SpecPrefetchError, match="cannot start prompt 'other'"):
            greedy_generate(h.model, Prompt("other", prompt.kwargs), NEW, start=start)
        adopted.activate()
        gen = greedy_generate(h.model, prompt, NEW, tokenizer=h.tokenizer, start=start)
        plain = h.plain_generations()[0]
    finally:
        for rt in reversed(rts):
            rt.uninstall()
            rt.close()
        h.close()
    assert gen.new_ids == plain.new_ids and len(gen.times) == NEW and gen.times == sorted(gen.times)
    assert adopted.stats().prefetched > 0 and resident.cache.used == h.store.total_experts


def test_adopted_state_equals_own_prefill_state(setup: dict[str, Any]) -> None:
    """Cache, pool bytes, events and the Naive predictor's state after adopting a prefill = after running it."""
    from specprefetch.runtime.measurement.decode import prefill

    h = _lockstep_harness(setup)
    prompt = h.prompts[0]
    rts = []
    try:
        for policy in ("off", "naive", "naive"):
            rt = h.runtime(policy, "ram", m_max=2, record=True).install()
            rt.reset_run()
            rts.append(rt)
        src, own, adopted = rts
        for rt in (src, own):
            rt.activate()
            rt.new_sequence()
            prefill(h.model, prompt, h.tokenizer)
        adopted.adopt(src)
    finally:
        for rt in reversed(rts):
            rt.uninstall()
            rt.close()
        h.close()
    assert list(adopted.cache.resident.items()) == list(own.cache.resident.items())
    assert adopted.cache.free == own.cache.free and adopted.cache.peak_used == own.cache.peak_used
    assert all(torch.equal(adopted.pool.record(s), own.pool.record(s)) for s in own.cache.resident.values())
    def routed(rt: OffloadedRuntime) -> list[tuple[int, int, list[int]]]:
        return [(e.step, e.layer, e.required) for e in rt.events]

    assert routed(adopted) == routed(own)
    assert adopted.step == own.step == 0
    for a, b in zip(adopted.provider.last, own.provider.last, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_all_resident_runs_share_one_pool_read_once(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness reads every expert once for all its all-resident runs: each slot holds the record the cache maps
    there, nothing is read again, and the runs decode the plain tokens; a pool of another store is refused."""
    from specprefetch.runtime.core.engine import resident_pool

    h = _lockstep_harness(setup)
    store = setup["store"]
    reads = []
    orig = type(store).layer_records
    monkeypatch.setattr(type(store), "layer_records", lambda self, l: reads.append(l) or orig(self, l))
    try:
        plain = [g.new_ids for g in h.plain_generations()]
        reads.clear()
        first = h.run("resident", "ram")
        assert reads == list(range(store.n_layers))
        again = h.run_lockstep([{"policy": "resident", "storage": "ram"}, {"policy": "off", "storage": "ram"}], "t")
        assert reads == list(range(store.n_layers))  # no read since
        rt = h.runtime("resident", "ram")
        rt.reset_run()
        assert rt.pool is h._resident and rt.shared_pool
        for l in (0, store.n_layers - 1):
            for e, rec in enumerate(orig(store, l)):
                assert torch.equal(rt.pool.record(rt.cache.slot((l, e))), rec)
        rt.close()
        other = resident_pool(store)
        other.capacity -= 1
        with pytest.raises(OffloadError, match="shared all-resident pool"):
            OffloadedRuntime(h.model, store, h.reader("ram"), RuntimeOptions(policy="resident"), spec=h.spec,
                             resident=other)
    finally:
        h.close()
    assert first.tokens() == plain and all(r.tokens() == plain for r in again)
    assert first.stats.ready_recall == 1.0 and again[0].stats.ready_recall == 1.0


def test_a_run_against_the_trained_models_decode() -> None:
    """``against_trained``: tokens compared with the trained model's, and the (token, layer) expert sets that differ
    (as sets: the order within a top-k does not count), aligned at the end (a block may prefill once)."""
    from types import SimpleNamespace

    from specprefetch.runtime.measurement.bench import against_trained

    ref = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])]  # 2 layers, 3 tokens
    trained = [([7, 8], ref)]

    def ev(step: int, layer: int, topk: list[list[int]]) -> Any:
        return SimpleNamespace(step=step, layer=layer, topk=torch.tensor(topk))

    same = [ev(0, 0, [[1, 0], [2, 3]]), ev(0, 1, [[1, 2], [4, 3]]), ev(1, 0, [[5, 4]]), ev(1, 1, [[5, 6]])]
    res = SimpleNamespace(events=same, tokens=lambda: [[7, 8]])
    assert against_trained(res, trained) == {"tokens_match_trained": True, "routing_diff_trained": 0,
                                             "routing_sets": 6}
    flipped = [*same[:3], ev(1, 1, [[5, 7]])]  # the last token's layer-1 set: a near-tie flipped
    res = SimpleNamespace(events=flipped[2:], tokens=lambda: [[7, 9]])  # no prefill events: aligned at the end
    assert against_trained(res, trained) == {"tokens_match_trained": False, "routing_diff_trained": 1,
                                             "routing_sets": 2}
    assert against_trained(res, None) == {}


def test_lookahead_plan_holds_each_distance_and_its_same_budget_control() -> None:
    """Per storage: OFF, SpecPrefetch at each d at its budget, and d = 1 at every other d's budget (the control that
    separates the longer window from the larger budget); a control that is already a run is not measured twice."""
    from specprefetch.config import section_defaults
    from specprefetch.runtime.measurement.bench import plan_experiments

    s = section_defaults("device", {"lookahead": {"distances": [1, 2, 3], "storages": ["nvme_cold", "slow_ufs"]}})
    plan = plan_experiments(s, {"nvme_cold": 2, "slow_ufs": 1}, ["lookahead"],
                            ahead_m_max={"nvme_cold": {1: 2, 2: 5, 3: 7}, "slow_ufs": {1: 1, 2: 1, 3: 2}})
    got = {(c.storage, c.policy, c.ahead, c.m_max) for c in plan["lookahead"]}
    assert got == {("nvme_cold", "off", 1, 0), ("nvme_cold", "specprefetch", 1, 2), ("nvme_cold", "specprefetch", 2, 5),
                   ("nvme_cold", "specprefetch", 3, 7), ("nvme_cold", "specprefetch", 1, 5),
                   ("nvme_cold", "specprefetch", 1, 7), ("slow_ufs", "off", 1, 0), ("slow_ufs", "specprefetch", 1, 1),
                   ("slow_ufs", "specprefetch", 2, 1), ("slow_ufs", "specprefetch", 3, 2),
                   ("slow_ufs", "specprefetch", 1, 2)}
    assert len(plan["lookahead"]) == len(got)


def test_pre_attention_prefetches_before_the_layers_attention(setup: dict[str, Any]) -> None:
    """Beyond the paper: the pre-attention policy predicts layer l+1 from its pre-attention norm's output after layer
    l is done and before layer l+1's router (its window: the attention), prefetches into layer l+1 only, leaves the
    tokens the plain model's, and its window excludes layer l's stall; its priorities are the predictor's on that
    norm output; the simulator replaying the run makes the same decisions."""
    from specprefetch.models.capture import RouterCapture
    from specprefetch.runtime.core.timeline import window_ms

    spec, n_layers = setup["spec"], setup["spec"].n_layers
    out, rt = run_policy(setup, "pre_attention", m_max=3, capacity=2 * spec.top_k + 3, sync=True, io_workers=1,
                         record=True)
    assert torch.equal(out, setup["ref"])
    dec = [ev for ev in rt.events if ev.n_tokens == 1]
    by = {(ev.step, ev.layer): ev for ev in dec}
    early = [ev for ev in dec if ev.layer + 1 < n_layers]
    assert early and all(ev.early and ev.t_pred is not None and ev.m_max == 3 for ev in early)
    for ev in early:  # after layer l is done, before layer l+1's demand is known
        nxt = by[(ev.step, ev.layer + 1)]
        assert ev.t_done <= ev.t_pred <= nxt.t_exec
        assert window_ms(ev, nxt) == pytest.approx((nxt.t_exec - ev.t_pred) * 1e3)
    assert all(ev.t_pred is None for ev in dec if ev.layer + 1 == n_layers)
    assert sum(ev.prefetch_used + ev.prefetch_wasted + ev.prefetch_cancelled for ev in dec) > 0
    # its compute profile (the routing record's timings, the simulator's run inputs): every duration >= 0, the
    # prediction in the gap to the next layer, not in the layer's own prediction durations
    from specprefetch.runtime.measurement.window import compute_profile

    comp = compute_profile(rt.events, n_layers)
    assert all(v >= 0 for k in ("book_s", "pred_s", "post_pred_s", "moe_s", "gap_s") for v in comp[k])
    assert comp["pred_s"] == comp["post_pred_s"] == [0.0] * n_layers and comp["head_s"] >= 0
    # the priorities of the last step's layer 1 are the predictor's on layer 1's pre-attention input
    pred = rt.provider.pred
    with RouterCapture(setup["model"], spec, pre_attention=True) as cap:  # the same run, its norms' outputs captured
        again, rt2 = run_policy(setup, "pre_attention", m_max=3, capacity=2 * spec.top_k + 3, sync=True, io_workers=1,
                                record=True)
        pre = cap.pre_attention_inputs()
    assert torch.equal(again, out)
    dec = [ev for ev in rt2.events if ev.n_tokens == 1]
    by = {(ev.step, ev.layer): ev for ev in dec}
    last = max(ev.step for ev in dec)
    with torch.no_grad():
        want = (pre[1][-1:].float() @ pred.A[0].T.float()) @ pred.B[0].T.float()
    torch.testing.assert_close(torch.as_tensor(by[(last, 0)].scores).float(), want[0], rtol=1e-4, atol=1e-4)
    # the simulator replays it: same counters
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, sequences_from_record, simulate

    zero = [0.0] * n_layers
    sim = simulate(sequences_from_record(routing_rows(rt.events), n_layers), "pre_attention", 3,
                   2 * spec.top_k + 3, spec.n_experts, spec.top_k, ComputeProfile(zero, zero, zero, [1e-3] * n_layers,
                                                                                  zero, 1e-3),
                   StorageProfile("ram", "ram"), io_workers=1, compute_opt=True, sync=True, fixed_transfer_s=0.0)
    assert all(ev.early for ev in sim.events if ev.n_tokens == 1 and ev.layer + 1 < n_layers)
    for name in ("hits", "misses", "prefetched", "wasted", "cancelled"):
        assert getattr(rt.stats(), name) == getattr(sim.stats, name), name


# ------------------------------------------------------------------------------------------ batch decoding
def _batch_ids(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of different lengths (5..8 tokens), left-padded with id 0, and their mask."""
    from specprefetch.runtime.measurement.decode import Prompt, collate

    g = torch.Generator().manual_seed(11)
    prompts = [Prompt(f"p{i}", {"input_ids": torch.randint(1, VOCAB, (1, 8 - i % 4), generator=g)})
               for i in range(batch)]
    p = collate(prompts, pad_id=0)
    return p.kwargs["input_ids"], p.kwargs["attention_mask"]


@pytest.mark.parametrize("policy", ["off", "specprefetch", "naive", "pre_attention", "resident"])
def test_batch_decoding_gives_the_plain_batched_tokens(setup: dict[str, Any], policy: str) -> None:
    """Beyond the paper: the runtime decodes a batch of 3 left-padded prompts (one token of each per step) with the
    plain model's batched greedy tokens; a decoding step's event has the batch's 3 tokens, its demand is their union,
    ReadyRecall counts every token, and the priorities are the paper's batch priorities (the summed per-token
    distributions)."""
    model, spec, store = setup["model"], setup["spec"], setup["store"]
    ids, mask, ref = setup["batch"]
    reader = ExpertReader(store, make_profile("ram", _device(emulation="bandwidth"), store.layout.payload_bytes))
    opts = RuntimeOptions(policy=policy, m_max=4, capacity=4 * spec.top_k + 4, sync_prefetch=True, io_workers=1,
                          record_routing=True, batch=3)
    rt = OffloadedRuntime(model, store, reader, opts, provider_for(policy, spec), spec=spec)
    try:
        rt.install()
        rt.reset_run()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    finally:
        rt.uninstall()
        rt.close()
        reader.close()
    assert torch.equal(out, ref), f"{setup['name']} {policy}"
    dec = [ev for ev in rt.events if ev.decode]
    assert dec and all(ev.n_tokens == 3 for ev in dec)
    assert not any(ev.decode for ev in rt.events if ev.n_tokens != 3)
    for ev in dec:
        assert ev.required == sorted({int(e) for e in ev.topk.reshape(-1).tolist()})
    st = rt.stats()
    assert st.n_tokens == NEW - 1 and 0.0 <= st.ready_recall <= 1.0
    if policy == "resident":
        assert st.ready_recall == 1.0
    if policy in ("specprefetch", "naive", "pre_attention"):
        assert st.prefetched > 0
    if policy == "specprefetch":  # the batch priorities: the softmax of each token's logits, summed
        with torch.no_grad():
            x = torch.randn(3, spec.hidden_size)
            pred = rt.provider.pred
            want = torch.softmax((x @ pred.A[0].T) @ pred.B[0].T, dim=-1).sum(dim=0)
        torch.testing.assert_close(torch.as_tensor(rt.provider.scores(0, x)), want, rtol=1e-5, atol=1e-6)


def test_naive_prefetch_counts_every_sequence_of_a_batch() -> None:
    """Naive Prefetch with a batch: the previous step's experts of every sequence, the ones more sequences used
    first; with one sequence, the previous token's experts by routing weight (the paper's)."""
    p = PreviousTokenPriority(n_layers=3, n_experts=6)
    p.batch = 2
    p.observe(0, torch.tensor([[2, 3], [0, 1], [4, 5], [3, 2]]), torch.ones(4, 2))  # prefill: 2 sequences x 2
    assert set(torch.nonzero(p.last[0]).flatten().tolist()) == {0, 1, 2, 3}  # each sequence's last token
    p.observe(1, torch.tensor([[0, 1], [1, 4]]), torch.tensor([[0.9, 0.1], [0.2, 0.8]]))  # one token of each
    s = p.last[1]
    assert s[1] > s[0] > s[4] > 0.0 and s[2] == s[3] == s[5] == 0.0  # expert 1: both sequences
    one = PreviousTokenPriority(n_layers=3, n_experts=6)
    one.observe(1, torch.tensor([[2, 3], [0, 5]]), torch.tensor([[0.5, 0.5], [0.3, 0.7]]))  # a 2-token prefill
    assert set(torch.nonzero(one.last[1]).flatten().tolist()) == {0, 5} and one.last[1][5] > one.last[1][0]


def test_collate_left_pads_text_prompts_only() -> None:
    from specprefetch.runtime.measurement.decode import Prompt, collate

    a = Prompt("a", {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)})
    b = Prompt("b", {"input_ids": torch.tensor([[8]])})
    p = collate([a, b], pad_id=0)
    assert p.id == "a+b" and p.batch == 2 and p.n_tokens == 3
    assert p.kwargs["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert p.kwargs["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    img = Prompt("c", {"input_ids": torch.tensor([[1]]), "pixel_values": torch.zeros(1, 3)})
    with pytest.raises(SpecPrefetchError, match="prompt 'c' cannot join a batch.*pixel_values"):
        collate([a, img], pad_id=0)


def test_batch_experiment_profiles_its_window_and_benchmarks_each_batch(tmp_path: Path) -> None:
    """The batch experiment's library path on a tiny model: profile-window measures the window of a batch of 2 and
    its budget per storage; the benchmark decodes batch 1 (the benchmark's prompt) and batch 2 (the pool's first two
    prompts, left-padded) in blocks of their own, OFF / SpecPrefetch at the batch's budget / all-resident, each run with
    the plain model's batched tokens, throughput over every sequence and an overlap bound; the simulator's validation
    leaves the batch runs out."""
    import csv

    from specprefetch.config import section_defaults
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.budget import batch_budgets
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.measurement.bench import bench_runtime
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness
    from specprefetch.runtime.measurement.window import profile_window
    from specprefetch.runtime.simulation.simrun import validate_simulator

    model = tiny_deepseek()
    spec = discover_routing(model)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec))
    s = section_defaults("device", {"n_prompts": 1, "max_new_tokens": 4, "repeats": 1, "io_workers": 2,
                                 "storages": ["nvme_cold"], "experiments": ["batch"],
                                 "batch": {"sizes": [1, 2], "storages": ["nvme_cold"]},
                                 "window": {"n_prompts": 1, "demand_m": [2], "transfer_samples": 4},
                                 "cache": {"capacity_experts": 12}})
    g = torch.Generator().manual_seed(3)
    pool = [Prompt(f"p{i}", {"input_ids": torch.randint(1, VOCAB, (1, n), generator=g),
                             "attention_mask": torch.ones(1, n).long()}) for i, n in enumerate((6, 4))]
    providers = provider_factories({}, spec, "cpu")
    adapter = random_adapter(spec)
    providers["specprefetch"] = lambda: PredictorPriority(adapter)
    h = Harness(model, spec, store, s, pool[:1], providers, batch_pool=pool)
    try:
        prof = profile_window(h, "tiny", "test-cpu", tmp_path / "window")
        assert set(prof["window_ms_median_batch"]) == {"2"} and prof["window_ms_median_batch"]["2"] > 0
        assert set(prof["m_max_batch_per_storage"]["2"]) == set(prof["m_max_per_storage"])
        budgets = batch_budgets(s, prof, prof["m_max_per_storage"])
        assert budgets[1]["nvme_cold"] == prof["m_max_per_storage"]["nvme_cold"]
        assert budgets[2]["nvme_cold"] == prof["m_max_batch_per_storage"]["2"]["nvme_cold"]
        plain2 = h.plain_tokens(h.batch_prompts(2))
        rows = bench_runtime(h, prof, "tiny", "test-cpu", tmp_path / "runs.csv", routing_out=tmp_path / "r.st")
    finally:
        h.close()
    with open(tmp_path / "runs.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) == 6
    assert {(r["batch"], r["policy"], r["block"]) for r in got} == {
        (str(b), p, "nvme_cold" + ("@b2" if b == 2 else ""))
        for b in (1, 2) for p in ("off", "specprefetch", "resident")}
    for r in got:
        b = int(r["batch"])
        assert r["tokens_match"] == "true" and int(r["n_tokens"]) == b * (s["max_new_tokens"] - 1)
        assert float(r["tokens_per_s"]) > 0 and 0 <= float(r["ready_recall"]) <= 1
        assert float(r["bound_tokens_per_s"]) > 0
        assert (r["tokens_match_trained"] != "") == (b == 1)  # the trained reference decodes one prompt at a time
        if r["policy"] == "specprefetch":
            assert int(r["m_max"]) == budgets[b]["nvme_cold"]
    assert len(plain2) == 2 and all(len(t) == s["max_new_tokens"] for t in plain2)
    from specprefetch.contracts import ROUTING_FORMAT, load_tensor_tree

    record = load_tensor_tree(tmp_path / "r.st", ROUTING_FORMAT, "routing record")
    val = validate_simulator(record, prof, s)
    assert val and {v["storage"] for v in val} == {"nvme_cold"}
    assert len({(v["policy"], v["inputs"], v["metric"]) for v in val
                if v["metric"] not in ("speedup", "service_ms")}) == 3 * 2 * 7
    # the disk's service time of the batch-1 runs that transferred (OFF, the prefetching policy), not of batches
    assert {(v["policy"], v["inputs"]) for v in val if v["metric"] == "service_ms"} == {("off", "profile"),
                                                                                     ("specprefetch", "profile")}
