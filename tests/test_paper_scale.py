"""Paper-scale experts: widened stand-in experts in the real model's shape, 4-bit store (runtime/core/paper_scale.py).

The added units must contribute exactly zero, the store must carry the real bytes, and every offloaded run must
decode the tokens of the plain model's greedy generate() on the same store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specprefetch.runtime.core.paper_scale import ExpertScale, ResidentExperts, WideMLP, scale_of, widen
from specprefetch.runtime.core.store import ExpertStore, RecordLayout, StoreError, build_expert_store

VOCAB = 96


def _deepseek(hidden: int, inter: int) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(3)
    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                           moe_intermediate_size=inter, num_hidden_layers=3, num_attention_heads=2,
                           num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                           first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128, topk_method="greedy",
                           n_group=None, topk_group=None)
    model = DeepseekV2ForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    return model


def test_the_paper_expert_is_194_mb_in_4_bits() -> None:
    """DeepSeek-VL2-Tiny's expert (3 x 1280 x 896) in 4 bits with bf16 scales per 64 weights: the paper's 1.94 MB."""
    layout = ExpertScale(1280, 896, format="int4", group_size=64).layout(128)
    assert layout.payload_bytes == 1_935_360 and layout.record_bytes % 4096 == 0
    assert layout.flops_per_token == 2 * 3 * 1280 * 896


@pytest.mark.parametrize("fmt", ["int4", "fp32"])
def test_added_units_contribute_exactly_zero(fmt: str) -> None:
    """A widened expert computes what the original computes in the same format (int4: bit for bit)."""
    torch.manual_seed(0)
    h, i = 64, 64
    gu, dn = torch.randn(2 * i, h) * 0.1, torch.randn(h, i) * 0.1
    scale = ExpertScale(256, 192, format=fmt)
    wide = scale.layout(h)
    big_gu, big_dn = widen(gu, dn, 256, 192, torch.Generator().manual_seed(1))
    assert big_dn[:, i:].abs().sum() == 0 and big_gu[i:192].abs().sum() > 0  # added units: live gate, zero down
    small = RecordLayout(h, i, wide.dtype, quant=wide.quant, group_size=wide.group_size)
    rec_w = torch.frombuffer(bytearray(wide.pack(big_gu, big_dn)), dtype=torch.uint8)
    rec_s = torch.frombuffer(bytearray(small.pack(gu, dn)), dtype=torch.uint8)
    x = torch.randn(3, h)
    act = torch.nn.SiLU()
    y_wide, y_small = wide.mlp(wide.views(rec_w), x, act), small.mlp(small.views(rec_s), x, act)
    assert y_wide.shape == (3, h)
    if fmt == "int4":
        assert torch.equal(y_wide, y_small)
    else:
        torch.testing.assert_close(y_wide, y_small, rtol=1e-5, atol=1e-6)
        exact = torch.nn.functional.linear(act(x @ gu[:i].T) * (x @ gu[i:].T), dn)
        torch.testing.assert_close(y_wide, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_offloaded_runs_decode_the_plain_models_tokens(tmp_path: Path, fmt: str) -> None:
    """Build a paper-scale store, widen the shared experts, and decode with every policy: tokens equal the plain
    model's greedy generate() over the same records (ResidentExperts), and the loads move the widened bytes."""
    from specprefetch.config import section_defaults
    from specprefetch.models.routing import discover_routing
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness

    model = _deepseek(64, 64)
    spec = discover_routing(model)
    scale = ExpertScale(128, 128, shared_intermediate_size=128, format=fmt, seed=7)
    store = ExpertStore(build_expert_store(model, tmp_path / "store", spec, model_name="t", scale=scale))
    assert scale_of(store) == scale and store.layout.hidden == 128 and store.layout.model_hidden == 64
    s = section_defaults("device", {"n_prompts": 1, "max_new_tokens": 6, "io_workers": 2,
                                 "cache": {"capacity_experts": 5}})
    torch.manual_seed(5)
    prompts = [Prompt("p0", {"input_ids": torch.randint(0, VOCAB, (1, 7)), "attention_mask": torch.ones(1, 7).long()})]
    h = Harness(model, spec, store, s, prompts, provider_factories({}, spec, "cpu"))
    try:
        assert all(isinstance(b.block.shared_experts, WideMLP) for b in h.blocks)
        plain = [g.new_ids for g in h.plain_generations()]
        assert all(isinstance(b.block.experts, torch.nn.Module) and not isinstance(b.block.experts, ResidentExperts)
                   for b in h.blocks)  # the plain experts were swapped back out
        for policy, storage, compute_opt in [("off", "nvme_cold", True), ("fate", "nvme", True),
                                             ("naive", "ram", False), ("resident", "ram", True)]:
            res = h.run(policy, storage, m_max=2, compute_opt=compute_opt)
            assert res.tokens() == plain, (policy, storage)
        assert res.stats.hits > 0
    finally:
        h.close()


def test_a_store_packed_by_another_torch_is_refused(tmp_path: Path) -> None:
    model = _deepseek(64, 64)
    root = build_expert_store(model, tmp_path / "store", scale=ExpertScale(64, 64, format="int4"))
    m = json.loads((root / "manifest.json").read_text())
    m["packed_by_torch"] = "1.0.0"
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="rebuild the store"):
        ExpertStore(root)


def test_int4_needs_whole_groups() -> None:
    from specprefetch.io import SpecPrefetchError

    with pytest.raises(SpecPrefetchError, match="multiple of the int4 group size"):
        ExpertScale(1280, 896, format="int4").check_fits(128, 48, "here")
    with pytest.raises(SpecPrefetchError, match="wider than the paper-scale"):
        ExpertScale(64, 64).check_fits(128, 64, "here")
