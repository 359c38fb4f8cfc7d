"""DeepSeek-VL2, natively (specprefetch/models/deepseek_vl2.py): conformance with the official code, weights, routing.

Conformance: ``tests/golden/deepseek_vl2_reference/<variant>/`` holds tiny random checkpoints written by the
official package (``DeepseekVLV2ForCausalLM.save_pretrained``, in its own layout) and what the official code computed
on them (``scripts/deepseek_vl2_reference.py``, in an isolated environment with the transformers version it imports
with): the processor's tensors, the logits and every MoE layer's experts per token. Our implementation loads the
same checkpoint by its weight names and must reproduce them: identical token ids and image tensors, identical top-k
expert sets for every token and layer, logits within 1e-4 (fp32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specprefetch.models import deepseek_vl2
from specprefetch.models.deepseek_vl2 import (
    DeepseekVL2Config,
    DeepseekVL2Error,
    DeepseekVL2ForCausalLM,
    DeepseekVL2Processor,
    load_model,
    save_official,
    select_best_resolution,
    to_official_state_dict,
)
from specprefetch.models.routing import discover_routing

REF = Path(__file__).resolve().parent / "golden" / "deepseek_vl2_reference"
VARIANTS = ("tiny", "small", "base")
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**language: Any) -> DeepseekVL2Config:
    """A tiny DeepSeek-VL2 config (56-px tiles of 14-px patches: 2 x 2 tokens per tile after the projector)."""
    lang = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 2,
            "n_routed_experts": 8, "num_experts_per_tok": 3, "first_k_dense_replace": 1, "topk_method": "greedy",
            "use_mla": False, "kv_lora_rank": None, "q_lora_rank": None, "qk_rope_head_dim": 0, "qk_nope_head_dim": 0,
            "v_head_dim": 0, "bos_token_id": 0, "eos_token_id": 1, **language}
    return DeepseekVL2Config(vision_config={"image_size": 56, "patch_size": 14, "width": 32, "layers": 2, "heads": 2,
                                            "mlp_ratio": 2},
                             projector_config={"input_dim": 32, "n_embed": 64},
                             candidate_resolutions=[[56, 56], [56, 112], [112, 56]], language_config=lang)


MLA = {"use_mla": True, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
       "v_head_dim": 16}
ROUTING_VARIANTS = {  # name -> language overrides
    "mha-greedy": {},
    "mla-group-limited": {**MLA, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    "mla-noaux-sigmoid": {**MLA, "q_lora_rank": 24, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                          "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2},
    "moe-every-2nd": {"moe_layer_freq": 2, "num_hidden_layers": 5},
}


def _model(**language: Any) -> DeepseekVL2ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekVL2ForCausalLM(tiny_config(**language)).eval()
    for gate in (layer.mlp.gate for layer in model.language.model.layers if hasattr(layer.mlp, "gate")):
        if hasattr(gate, "e_score_correction_bias"):  # zero at init: make it matter
            gate.e_score_correction_bias.data.normal_(0, 0.05)
    return model


# ------------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("variant", sorted(ROUTING_VARIANTS))
def test_routing_is_discovered_and_replayed(variant: str) -> None:
    """Discovery finds the official MoE rule's layers; recomputed top-k equals what each Router executed."""
    from tests.test_models import _check_replay

    model = _model(**ROUTING_VARIANTS[variant])
    spec = discover_routing(model)
    c = model.config.text
    want = [i for i in range(c.num_hidden_layers) if i >= 1 and i % c.moe_layer_freq == 0]
    assert (spec.arch, spec.moe_layers, spec.n_experts, spec.top_k, spec.n_shared_experts) == (
        "deepseek_vl2", want, 8, 3, 2)
    assert (spec.scoring, spec.topk_method, spec.norm_topk_prob) == (c.scoring_func, c.topk_method, c.norm_topk_prob)
    ids = torch.randint(2, 300, (2, 13), generator=torch.Generator().manual_seed(1))
    _check_replay(model, spec, {"input_ids": ids})


def test_router_weights_follow_the_official_gate() -> None:
    """norm_topk_prob renormalises the chosen scores, then routed_scaling_factor scales them."""
    model = _model(**ROUTING_VARIANTS["mla-noaux-sigmoid"])
    gate = model.language.model.layers[1].mlp.gate
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    _, weights, experts = gate(x)
    torch.testing.assert_close(weights.sum(-1), torch.full((5,), 2.5))
    assert experts.shape == (5, 3) and len({tuple(sorted(r)) for r in experts.tolist()}) >= 1


# ------------------------------------------------------------------------------------------ weights
def test_official_layout_round_trip(tmp_path: Path) -> None:
    """save_official writes per-expert tensors under the official names; load_model rebuilds the same model."""
    model = _model()
    save_official(model, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "language.model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "language.model.layers.1.mlp.shared_experts.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    assert {"vision.pos_embed", "vision.blocks.0.attn.qkv.weight", "projector.layers.2.weight", "image_newline",
            "view_seperator", "language.model.layers.0.self_attn.q_proj.weight"} <= names
    again = load_model(tmp_path)
    ids = torch.randint(2, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert to_official_state_dict(again).keys() == names


@pytest.mark.parametrize("damage", ["missing-expert", "wrong-shape", "extra-tensor", "truncated"])
def test_bad_checkpoint_is_named(damage: str, tmp_path: Path) -> None:
    save_official(_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
        match = re.escape(f"{path}: unreadable safetensors file")
    else:
        if damage == "missing-expert":
            del tensors["language.model.layers.2.mlp.experts.5.up_proj.weight"]
            match = r"layers\.2\.mlp\.experts\.\*\.up_proj\.weight misses experts \[5\]"
        elif damage == "wrong-shape":
            tensors["image_newline"] = torch.zeros(65)
            match = "image_newline has shape"
        else:
            tensors["language.model.layers.1.mlp.bogus.weight"] = torch.zeros(2)
            match = "unexpected.*bogus"
        save_file(tensors, str(path))
    with pytest.raises(DeepseekVL2Error, match=match):
        load_model(tmp_path)


def _shard(directory: Path, extra: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Split ``directory``'s model.safetensors into two shards named by model.safetensors.index.json."""
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for i, (file, part) in enumerate(shards.items()):
        save_file({n: tensors[n] for n in part} | ((extra or {}) if i else {}), str(directory / file))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_sharded_checkpoint_is_read_by_its_index(tmp_path: Path) -> None:
    model = _model()
    save_official(model, tmp_path)
    _shard(tmp_path)
    again = load_model(tmp_path)
    ids = torch.randint(2, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("damage", ["missing-shard", "escaping-name", "not-json", "duplicate-tensor"])
def test_bad_index_is_named(damage: str, tmp_path: Path) -> None:
    save_official(_model(), tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    shard = tmp_path / "model-00002-of-00002.safetensors"
    if damage == "duplicate-tensor":
        first = load_file(str(tmp_path / "model.safetensors"))
        name = sorted(first)[0]  # lands in shard 1; put it into shard 2 as well
        _shard(tmp_path, extra={name: first[name]})
        match = re.escape(f"{shard}: tensor {name} is also in model-00001-of-00002.safetensors")
    else:
        weight_map = _shard(tmp_path)
        if damage == "missing-shard":
            shard.unlink()
            match = re.escape(f"{shard}: DeepSeek-VL2 weights (listed in {index.name}) not found")
        elif damage == "escaping-name":
            weight_map[next(iter(weight_map))] = "../elsewhere.safetensors"
            index.write_text(json.dumps({"weight_map": weight_map}))
            match = re.escape(f"{tmp_path}: {index.name} weight_map names '../elsewhere.safetensors'")
        else:
            index.write_text("{")
            match = re.escape(f"{index}:1: not valid JSON")
    with pytest.raises(DeepseekVL2Error, match=match):
        load_model(tmp_path)


def test_no_shared_experts_add_nothing() -> None:
    """n_shared_experts: null: a 0-dim zero (no tensor of the input's size), logits bit-identical to adding
    zeros_like."""
    model = _model(n_shared_experts=None)
    zeros = [layer.mlp.shared_experts for layer in model.language.model.layers if hasattr(layer.mlp, "gate")]
    assert zeros and all(isinstance(z, deepseek_vl2._Zero) for z in zeros)
    x = torch.randn(2, 5, 64)
    assert zeros[0](x).shape == () and zeros[0](x).dtype == x.dtype
    ids = torch.randint(2, 300, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours = model(ids).logits
        for z in zeros:
            z.forward = torch.zeros_like  # the full-size zero it used to allocate
        full = model(ids).logits
    assert torch.equal(ours.view(torch.int32), full.view(torch.int32))


def test_image_tokens_are_laid_out_with_tile_tags() -> None:
    """Global view rows each end in image_newline, then view_seperator, then the local grid's rows (2x1 tiles)."""
    model = _model()
    images = torch.randn(1, 3, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    feats = model.image_tokens(images[0], [(2, 1)])
    h = w = 2
    assert feats.shape[0] == h * (w + 1) + 1 + (1 * h) * (2 * w + 1)
    newline, sep = model.image_newline.detach(), model.view_seperator.detach()
    rows_global = [feats[r * (w + 1) + w] for r in range(h)]
    rows_local = [feats[h * (w + 1) + 1 + r * (2 * w + 1) + 2 * w] for r in range(h)]
    assert all(torch.equal(t, newline) for t in rows_global + rows_local)
    assert torch.equal(feats[h * (w + 1)], sep)
    local = model.projector(model.vision(images[0, 1:]))  # tile 0 then tile 1, side by side
    torch.testing.assert_close(feats[h * (w + 1) + 1: h * (w + 1) + 1 + w], local[0, :w])
    torch.testing.assert_close(feats[h * (w + 1) + 1 + w: h * (w + 1) + 1 + 2 * w], local[1, :w])


def test_best_resolution_matches_the_official_rule() -> None:
    cands = [[384, 384], [384, 768], [768, 384], [768, 768]]
    assert select_best_resolution((800, 400), cands) == (768, 384)
    assert select_best_resolution((300, 700), cands) == (384, 768)
    assert select_best_resolution((100, 100), cands) == (384, 384)


# ------------------------------------------------------------------------------------------ conformance
def _reference(variant: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    d = REF / variant
    if not (d / "reference.json").is_file():
        pytest.fail(f"{d}: conformance fixture missing; run `python scripts/deepseek_vl2_reference.py --out {REF}`")
    return json.loads((d / "reference.json").read_text()), load_file(str(d / "reference.safetensors")), d


@pytest.mark.parametrize("variant", VARIANTS)
def test_conformance_with_the_official_code(variant: str) -> None:
    meta, ref, d = _reference(variant)
    ckpt = d / "checkpoint"
    model = load_model(ckpt)
    proc = DeepseekVL2Processor.from_pretrained(ckpt)
    spec = discover_routing(model)
    for case in meta["cases"]:
        name = case["name"]
        image = None
        if case.get("image"):
            from PIL import Image

            image = Image.open(REF / case["image"]).convert("RGB")
        enc = proc(case["prompt"], [image] if image is not None else [])
        assert enc["sft_format"] == case["sft_format"], name
        for key in ("input_ids", "images_seq_mask", "images_spatial_crop"):
            assert torch.equal(enc[key].to(ref[f"{name}.{key}"].dtype), ref[f"{name}.{key}"]), f"{name}: {key}"
        torch.testing.assert_close(enc["images"], ref[f"{name}.images"], rtol=0, atol=1e-6)
        kwargs = {k: ref[f"{name}.{k}"] for k in ("input_ids", "images", "images_seq_mask", "images_spatial_crop",
                                                   "attention_mask")}
        from tests.test_models import GateRecorder

        rec = GateRecorder(spec.gates)
        with torch.no_grad():
            embeds = model.prepare_inputs_embeds(**kwargs)
            out = model(**kwargs).logits
        rec.close()
        torch.testing.assert_close(embeds, ref[f"{name}.inputs_embeds"], rtol=0, atol=1e-5)
        torch.testing.assert_close(out, ref[f"{name}.logits"], rtol=0, atol=1e-4)
        for i, layer in enumerate(spec.moe_layers):
            order = rec.indices[i][0].sort(-1)
            theirs = ref[f"{name}.topk_idx_sorted.{layer}"]
            assert torch.equal(order.values, theirs), f"{name}: experts of layer {layer} differ"
            ours_w = rec.weights[i][0].gather(1, order.indices)
            torch.testing.assert_close(ours_w, ref[f"{name}.topk_weight_sorted.{layer}"], rtol=0, atol=1e-5)
        # Greedy decoding with our KV cache = the official model's greedy argmax recomputed without a cache.
        with torch.no_grad():
            new = model.generate(**kwargs, max_new_tokens=5, do_sample=False)[:, kwargs["input_ids"].shape[1]:]
        assert torch.equal(new, ref[f"{name}.greedy_nocache.tokens"]), f"{name}: greedy tokens differ"
