"""Model zoo: router discovery per arch, exact top-k replay, capture, stand-ins, loading, pretraining, CLI.

Executed experts are taken from each gate's own output (a forward hook in the test only), so the replay in
``RoutingSpec.topk`` is checked against what transformers actually runs. DeepSeek-VL2 (our implementation) is
tested in ``tests/test_deepseek_vl2.py``, against the official code's outputs.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from specprefetch.config import ConfigError
from specprefetch.models import (
    SUPPORTED_ARCHS,
    EncodedSample,
    collate_encoded,
    discover_routing,
    encode_sample,
    load_bundle,
)
from specprefetch.models.capture import RouterCapture
from specprefetch.models.loading import ModelBundle
from specprefetch.models.routing import RoutingError, RoutingSpec, select_experts
from specprefetch.models.standins import build_stand_in, save_stand_in

STANDINS = ("tiny-qwen3-vl-moe", "tiny-deepseek-vl2")


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ tiny models
def _tiny(arch: str, **over: Any) -> nn.Module:
    """A tiny randomly initialised transformers MoE model of ``arch`` (float32, eval mode)."""
    import transformers as t

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0)
    if arch == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(**common, num_hidden_layers=6, head_dim=16, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3],
                               norm_topk_prob=True)
        cls = t.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = t.MixtralConfig(**common, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2)
        cls = t.MixtralForCausalLM
    elif arch == "olmoe":
        cfg = t.OlmoeConfig(**common, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3)
        cls = t.OlmoeForCausalLM
    elif arch in ("deepseek_v2", "deepseek_v3"):
        mla = dict(kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                   n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=16,
                   first_k_dense_replace=1, num_hidden_layers=4)
        common["num_key_value_heads"] = 2
        if arch == "deepseek_v2":
            cfg = t.DeepseekV2Config(**common, **mla, topk_method=over.pop("topk_method", "greedy"),
                                     n_group=over.pop("n_group", None), topk_group=over.pop("topk_group", None))
            cls = t.DeepseekV2ForCausalLM
        else:
            cfg = t.DeepseekV3Config(**common, **mla, n_group=2, topk_group=1, norm_topk_prob=True)
            cls = t.DeepseekV3ForCausalLM
    else:
        raise AssertionError(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if arch == "deepseek_v3":  # make the correction bias matter (it is zero at init)
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.05)
    return model


EXPECTED = {  # arch -> (moe layers, n, K, D, scoring, shared)
    "qwen3_moe": ([1, 5], 8, 2, 32, "softmax", 0),  # decoder_sparse_step 2 -> 1, 3, 5; 3 is in mlp_only_layers
    "mixtral": ([0, 1, 2], 8, 2, 32, "softmax", 0),
    "olmoe": ([0, 1, 2], 8, 3, 32, "softmax", 0),
    "deepseek_v2": ([1, 2, 3], 8, 2, 32, "softmax", 2),
    "deepseek_v3": ([1, 2, 3], 8, 2, 32, "sigmoid", 2),
}


class GateRecorder:
    """Test-only: records what each gate returned (transformers routers return (logits, weights, indices))."""

    def __init__(self, gates: list[nn.Module]) -> None:
        self.indices: list[list[torch.Tensor]] = [[] for _ in gates]
        self.logits: list[list[torch.Tensor]] = [[] for _ in gates]
        self.weights: list[list[torch.Tensor]] = [[] for _ in gates]
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(gates)]

    def _hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.logits[i].append(out[0].detach())
            self.weights[i].append(out[1].detach())
            self.indices[i].append(out[2].detach())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _sets(idx: torch.Tensor) -> torch.Tensor:
    return idx.sort(dim=-1).values


def _check_replay(model: nn.Module, spec: RoutingSpec, kwargs: dict[str, Any]) -> None:
    """Recomputed logits/top-k equal what the model executed, and capture leaves outputs bit-identical."""
    with torch.no_grad():
        plain = model(**kwargs).logits
        rec = GateRecorder(spec.gates)
        with RouterCapture(model, spec) as cap:
            captured = model(**kwargs).logits
        rec.close()
    assert torch.equal(plain, captured), "capture changed the forward's output"
    assert all(not g._forward_pre_hooks for g in spec.gates), "hooks left behind"
    xs = cap.inputs()
    assert len(xs) == spec.n_layers
    for i, x in enumerate(xs):
        assert x.shape[1] == spec.hidden_size
        logits = spec.logits(i, x)
        assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], spec.n_experts)
        torch.testing.assert_close(logits, rec.logits[i][0].float(), rtol=1e-5, atol=1e-5)
        executed = rec.indices[i][0]
        assert torch.equal(_sets(spec.topk(i, logits)), _sets(executed)), f"layer {i}: top-k differs"
        assert torch.equal(_sets(spec.executed_topk(i, x)), _sets(executed))
        torch.testing.assert_close(spec.probs(i, logits).sum(-1), torch.ones(x.shape[0]))


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_transformers_arch_routing(arch: str) -> None:
    model = _tiny(arch)
    spec = discover_routing(model)
    layers, n, k, d, scoring, shared = EXPECTED[arch]
    assert (spec.arch, spec.moe_layers, spec.n_experts, spec.top_k, spec.hidden_size) == (arch, layers, n, k, d)
    assert (spec.scoring, spec.n_shared_experts) == (scoring, shared)
    assert all(g is model.model.layers[i].mlp.gate for g, i in zip(spec.gates, spec.moe_layers))
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    _check_replay(model, spec, {"input_ids": ids})
    if arch == "deepseek_v3":
        assert spec.topk_method == "noaux_tc" and "gate.0.e_score_correction_bias" in spec.router_tensors()


def test_deepseek_v2_group_limited_greedy() -> None:
    model = _tiny("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    spec = discover_routing(model)
    assert (spec.topk_method, spec.n_group, spec.topk_group) == ("group_limited_greedy", 4, 2)
    _check_replay(model, spec, {"input_ids": torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(3))})


def test_executed_topk_replays_bf16_router() -> None:
    """Qwen-style routers compute logits in the model dtype; executed_topk replays that, not float32."""
    model = _tiny("olmoe").to(torch.bfloat16)
    spec = discover_routing(model)
    ids = torch.randint(1, 64, (4, 32), generator=torch.Generator().manual_seed(5))
    rec = GateRecorder(spec.gates)
    with torch.no_grad(), RouterCapture(model, spec) as cap:
        model(input_ids=ids)
    rec.close()
    for i, x in enumerate(cap.inputs()):
        assert x.dtype == torch.bfloat16
        assert torch.equal(_sets(spec.executed_topk(i, x)), _sets(rec.indices[i][0]))


def test_capture_accumulates_and_casts_lazily() -> None:
    model = _tiny("mixtral")
    spec = discover_routing(model)
    with torch.no_grad(), RouterCapture(model, spec, dtype=torch.bfloat16) as cap:
        model(input_ids=torch.randint(1, 64, (1, 5)))
        model(input_ids=torch.randint(1, 64, (1, 3)))
    xs = cap.inputs()
    assert cap.n_forwards == 2 and [x.shape for x in xs] == [torch.Size([8, 32])] * 3
    assert all(x.dtype == torch.bfloat16 for x in xs)
    assert all(lg.dtype == torch.float32 for lg in cap.logits())
    cap.clear()
    with pytest.raises(Exception, match="no router input captured"):
        cap.inputs()


def test_unknown_arch_lists_supported() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(RoutingError) as err:
        discover_routing(model)
    msg = str(err.value)
    assert "'llama'" in msg
    for arch in SUPPORTED_ARCHS:
        assert arch in msg


def test_select_experts_rejects_bad_groups() -> None:
    with pytest.raises(RoutingError, match="n_group"):
        select_experts(torch.randn(2, 8), 2, topk_method="noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(RoutingError, match="unknown topk_method"):
        select_experts(torch.randn(2, 8), 2, topk_method="bogus")


# ------------------------------------------------------------------------------------------ stand-ins
def _image(path: Path, seed: int, size: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


@pytest.fixture(scope="module")
def saved_standins(tmp_path_factory: pytest.TempPathFactory, smoke_cfg: dict[str, Any],
                   tiny_tokenizer: Any) -> dict[str, tuple[Path, Any]]:
    """Each stand-in built (seed 0), saved; returns name -> (dir, the in-memory model)."""
    out = {}
    for name in STANDINS:
        torch.manual_seed(0)
        s = build_stand_in(smoke_cfg, name, tiny_tokenizer)
        d = tmp_path_factory.mktemp("standin") / name
        save_stand_in(s, d)
        out[name] = (d, s.model.eval())
    return out


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory, smoke_cfg: dict[str, Any]) -> Path:
    root = tmp_path_factory.mktemp("images")
    (root / "images").mkdir()
    size = smoke_cfg["image"]["size"]
    _image(root / "images" / "a.png", 0, size)
    _image(root / "images" / "b.png", 1, size)
    return root


SAMPLE = {"id": "t-0", "prompt": "What is 3 plus 4?", "reference": "the answer is 7.", "image": "images/a.png"}


@pytest.mark.parametrize("name", STANDINS)
def test_standin_routing_masks_and_round_trip(name: str, smoke_cfg: dict[str, Any], saved_standins: Any,
                                              image_root: Path) -> None:
    d, original = saved_standins[name]
    bundle = load_bundle(smoke_cfg, name, d)
    m = smoke_cfg["models"][name]
    spec = bundle.routing
    assert spec.arch == m["arch"] and spec.n_experts == m["n_experts"] and spec.top_k == m["top_k"]
    assert spec.n_layers == m["num_hidden_layers"] - m["first_dense_layers"]
    assert spec.moe_layers[0] == m["first_dense_layers"] and spec.n_shared_experts == m["n_shared_experts"]
    assert not bundle.model.training
    enc = encode_sample(bundle, SAMPLE, image_root)
    s = enc.length
    assert enc.input_ids.shape == enc.is_prompt.shape == enc.is_image.shape == enc.valid.shape == (s,)
    assert enc.is_image.sum() > 0 and enc.valid.all() and not enc.truncated
    assert bool(enc.is_prompt[enc.is_image].all()), "image tokens belong to the prompt"
    first_ref = int((~enc.is_prompt).nonzero()[0])
    assert enc.is_prompt[:first_ref].all() and not enc.is_prompt[first_ref:].any()
    assert enc.input_ids[-1] == bundle.tokenizer.eos_token_id
    with torch.no_grad():
        loaded = bundle.model(**enc.kwargs).logits
        ref = original(**enc.kwargs).logits
    assert torch.equal(loaded, ref), "save/load round trip changed the logits"
    _check_replay_standin(bundle, enc)


def _check_replay_standin(bundle: ModelBundle, enc: EncodedSample) -> None:
    spec = bundle.routing
    rec = GateRecorder(spec.gates)
    with torch.no_grad(), RouterCapture(bundle.model, spec) as cap:
        bundle.model(**enc.kwargs)
    rec.close()
    for i, x in enumerate(cap.inputs()):
        assert x.shape == (enc.length, spec.hidden_size)
        assert torch.equal(_sets(spec.topk(i, spec.logits(i, x))), _sets(rec.indices[i][0]))


@pytest.mark.parametrize("name", STANDINS)
def test_standin_logits_depend_on_image(name: str, smoke_cfg: dict[str, Any], saved_standins: Any,
                                        image_root: Path) -> None:
    bundle = load_bundle(smoke_cfg, name, saved_standins[name][0])
    a = encode_sample(bundle, SAMPLE, image_root)
    b = encode_sample(bundle, {**SAMPLE, "image": "images/b.png"}, image_root)
    assert torch.equal(a.input_ids, b.input_ids)
    with torch.no_grad():
        la, lb = bundle.model(**a.kwargs).logits, bundle.model(**b.kwargs).logits
    text = ~a.is_image
    assert not torch.allclose(la[0, text], lb[0, text]), "the image does not reach the text tokens"
    no_img = encode_sample(bundle, {**SAMPLE, "image": None}, image_root)
    assert not no_img.is_image.any() and no_img.length < a.length


@pytest.mark.parametrize("name", STANDINS)
def test_truncation_keeps_image_tokens(name: str, smoke_cfg: dict[str, Any], saved_standins: Any,
                                       image_root: Path) -> None:
    bundle = load_bundle(smoke_cfg, name, saved_standins[name][0])
    full = encode_sample(bundle, SAMPLE, image_root)
    n_img = int(full.is_image.sum())
    cut = encode_sample(bundle, SAMPLE, image_root, max_length=n_img + 4)
    assert cut.truncated and cut.length == n_img + 4 and int(cut.is_image.sum()) == n_img
    with torch.no_grad():
        bundle.model(**cut.kwargs)  # still a consistent forward (all image features placed)
    with pytest.raises(Exception, match="image tokens"):
        encode_sample(bundle, SAMPLE, image_root, max_length=n_img // 2)


def test_collate_pads_and_batches(smoke_cfg: dict[str, Any], saved_standins: Any, image_root: Path) -> None:
    name = "tiny-qwen3-vl-moe"
    bundle = load_bundle(smoke_cfg, name, saved_standins[name][0])
    items = [encode_sample(bundle, SAMPLE, image_root), encode_sample(bundle, {**SAMPLE, "image": None}, image_root)]
    pad = bundle.meta["special_token_ids"]["<|pad|>"]
    kwargs, masks = collate_encoded(items, pad)
    assert kwargs["input_ids"].shape == (2, items[0].length) and kwargs["input_ids"][1, -1] == pad
    assert masks["valid"][1].sum() == items[1].length and masks["is_image"][1].sum() == 0
    with torch.no_grad():
        batched = bundle.model(**kwargs).logits
        single = bundle.model(**items[1].kwargs).logits
    torch.testing.assert_close(batched[1, : items[1].length], single[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key,value", [("n_experts", 12), ("top_k", 3), ("hidden_size", 64),
                                       ("first_dense_layers", 1), ("n_shared_experts", 1)])
def test_config_mismatch_names_key(key: str, value: int, smoke_cfg: dict[str, Any], saved_standins: Any) -> None:
    name = "tiny-qwen3-vl-moe"
    cfg = copy.deepcopy(smoke_cfg)
    cfg["models"][name][key] = value
    with pytest.raises(ConfigError, match=f"models.{name}.{key}"):
        load_bundle(cfg, name, saved_standins[name][0])


def test_load_errors_name_the_problem(smoke_cfg: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        load_bundle(smoke_cfg, "nope", tmp_path)
    with pytest.raises(Exception, match="not found"):
        load_bundle(smoke_cfg, "tiny-qwen3-vl-moe", tmp_path / "missing")
    with pytest.raises(Exception, match="specprefetch_model.json"):
        load_bundle(smoke_cfg, "tiny-qwen3-vl-moe", tmp_path)


def test_hub_unreachable_error_names_hub_id(smoke_cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    cfg = copy.deepcopy(smoke_cfg)
    cfg["models"]["hubby"] = {**cfg["models"]["tiny-qwen3-vl-moe"], "source": "hub",
                              "hub_id": "specprefetch-test/not-a-model", "revision": "0" * 40}
    cfg["models"]["hubby"].pop("pretrain")
    with pytest.raises(Exception) as err:
        load_bundle(cfg, "hubby")
    assert "specprefetch-test/not-a-model" in str(err.value) and "models.hubby.path" in str(err.value)


# ------------------------------------------------------------------------------------------ pretraining
def _mean_lm_loss(bundle: ModelBundle, samples: list[Any], root: Path) -> float:
    from specprefetch.models.pretrain import _target_labels, lm_loss

    total = 0.0
    with torch.no_grad():
        for s in samples:
            e = encode_sample(bundle, s, root, 64)
            lab = _target_labels(e.kwargs, {"is_image": e.is_image[None], "valid": e.valid[None]})
            total += float(lm_loss(bundle.model(**e.kwargs).logits, lab))
    return total / len(samples)


@pytest.mark.parametrize("name", STANDINS)
def test_pretrain_lowers_loss_and_is_deterministic(name: str, smoke_cfg: dict[str, Any], tiny_tokenizer_dir: Path,
                                                   tiny_corpus_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from specprefetch.data.workloads import read_workload
    from specprefetch.io import seed_everything
    from specprefetch.models.pretrain import TRAIN_LOG, param_digest, pretrain_stand_in, split_heldout
    from specprefetch.models.standins import build_stand_in

    cfg = copy.deepcopy(smoke_cfg)
    pcfg = cfg["models"][name]["pretrain"]
    pcfg.update(steps=3, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=1)
    log_a = pretrain_stand_in(cfg, name, tiny_corpus_dir, tiny_tokenizer_dir, tmp_path / "a")
    pretrain_stand_in(cfg, name, tiny_corpus_dir, tiny_tokenizer_dir, tmp_path / "b")
    a, b = load_bundle(cfg, name, tmp_path / "a"), load_bundle(cfg, name, tmp_path / "b")
    assert param_digest(a.model) == param_digest(b.model), "same seed gave different weights"

    samples = read_workload(tiny_corpus_dir)
    train_idx, _ = split_heldout(len(samples), pcfg["seed"])
    probe = [samples[i] for i in train_idx[:6]]
    seed_everything(pcfg["seed"])
    init = build_stand_in(cfg, name, AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    init_bundle = ModelBundle(name=name, arch=a.arch, kind="stand_in", model=init.model.eval(),
                              tokenizer=init.tokenizer, image_processor=init.image_processor, routing=a.routing,
                              model_cfg=cfg["models"][name], meta=init.meta)
    assert _mean_lm_loss(a, probe, tiny_corpus_dir) < _mean_lm_loss(init_bundle, probe, tiny_corpus_dir) - 0.01

    saved = json.loads((tmp_path / "a" / TRAIN_LOG).read_text())
    assert saved["loss_curve"] == log_a["loss_curve"] and len(saved["loss_curve"]) == 3
    r = saved["routing"]
    assert len(r["layers"]) == a.routing.n_layers
    assert all(sum(layer["load_histogram"]) == r["n_heldout_tokens"] * a.routing.top_k for layer in r["layers"])
    assert 0 <= r["fate_recall_at_k"] <= 1 and math.isclose(r["chance_recall_at_k"],
                                                             a.routing.top_k / a.routing.n_experts)
    assert saved["unigram"]["unigram_entropy_nats"] > 0 and "config_hash" in saved["provenance"]


def test_pretrain_rejects_bad_inputs(smoke_cfg: dict[str, Any], tiny_corpus_dir: Path, tmp_path: Path) -> None:
    from specprefetch.models.pretrain import pretrain_stand_in

    with pytest.raises(Exception, match="tokenizer not found"):
        pretrain_stand_in(smoke_cfg, "tiny-qwen3-vl-moe", tiny_corpus_dir, tmp_path / "none", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ CLI
def test_cli_inspect_model(saved_standins: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from specprefetch.cli import main

    repo = Path(__file__).resolve().parent.parent
    d = saved_standins["tiny-deepseek-vl2"][0]
    rc = main(["inspect-model", "--config", str(repo / "config" / "smoke.yaml"), "--model", "tiny-deepseek-vl2",
               "--model-dir", str(d)])
    assert rc == 0
    out = capsys.readouterr().out
    info = json.loads(out[out.index("{"):])
    assert info["arch"] == "deepseek_vl2_standin" and info["moe_layers"] == [1, 2] and info["n_shared_experts"] == 1


def test_batch_plan_is_seeded_and_length_grouped() -> None:
    from specprefetch.models.pretrain import batch_plan

    lengths = [(i * 37) % 101 for i in range(50)]
    plan = batch_plan(lengths, steps=20, batch_size=4, seed=3, pool_batches=4)
    assert plan == batch_plan(lengths, steps=20, batch_size=4, seed=3, pool_batches=4)
    assert plan != batch_plan(lengths, steps=20, batch_size=4, seed=4, pool_batches=4)
    assert len(plan) == 20 and all(len(b) == 4 for b in plan)
    assert all([lengths[i] for i in b] == sorted(lengths[i] for i in b) for b in plan)
    first_epoch = [i for b in plan for i in b][:48]  # 3 pools of 16 from the first shuffle
    assert len(set(first_epoch)) == 48


def test_router_param_group_and_per_layer_aux(smoke_cfg: dict[str, Any], tiny_tokenizer: Any) -> None:
    from specprefetch.models.pretrain import ROUTER_LR_MULT, aux_loss, param_groups

    s = build_stand_in(smoke_cfg, "tiny-deepseek-vl2", tiny_tokenizer)
    spec = discover_routing(s.model)
    rest, routers = param_groups(s.model, spec, 1e-3, ROUTER_LR_MULT)
    assert {id(p) for p in routers["params"]} == {id(g.weight) for g in spec.gates}
    assert routers["lr"] == 1e-3 * ROUTER_LR_MULT and routers["weight_decay"] == 0.0
    assert len(rest["params"]) + len(routers["params"]) == len(list(s.model.parameters()))
    n, k = spec.n_experts, spec.top_k
    uniform = [torch.zeros(6, n) for _ in spec.gates]
    assert math.isclose(float(aux_loss(uniform, spec, torch.ones(1, 6))), k, rel_tol=1e-5)  # minimum: K
    collapsed = [torch.zeros(6, n), torch.zeros(6, n).index_fill_(1, torch.arange(k), 20.0)]
    assert float(aux_loss(collapsed, spec, torch.ones(1, 6))) > k * 1.5
    with pytest.raises(Exception, match="router logits of 2 MoE layers"):
        aux_loss(uniform[:1], spec, torch.ones(1, 6))


def test_balance_window_counts_loads_over_steps(smoke_cfg: dict[str, Any], tiny_tokenizer: Any) -> None:
    """Global-batch balancing: one step's loss equals the per-batch loss; over a window, a batch that uses half
    the experts is not penalised when the window's other batch used the other half."""
    from specprefetch.models.pretrain import BalanceWindow, aux_loss

    s = build_stand_in(smoke_cfg, "tiny-deepseek-vl2", tiny_tokenizer)
    spec = discover_routing(s.model)
    n, k = spec.n_experts, spec.top_k
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 5, n, generator=gen) for _ in spec.gates]
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    assert math.isclose(float(aux_loss(logits, spec, mask, BalanceWindow(8))), float(aux_loss(logits, spec, mask)),
                        rel_tol=1e-5)
    half = n // 2

    def skewed(first: int) -> list[torch.Tensor]:
        lg = torch.zeros(6, n)
        lg[:, first:first + half] = 5.0
        return [lg.clone() for _ in spec.gates]

    window = BalanceWindow(2)
    aux_loss(skewed(0), spec, torch.ones(1, 6), window)
    windowed = float(aux_loss(skewed(half), spec, torch.ones(1, 6), window))
    per_batch = float(aux_loss(skewed(half), spec, torch.ones(1, 6)))
    assert windowed < per_batch - 0.5 * k
    assert len(window.counts) == 2
    aux_loss(skewed(0), spec, torch.ones(1, 6), window)
    assert len(window.counts) == 2  # the oldest batch left the window


@pytest.mark.parametrize("name", STANDINS)
def test_vision_stage_reconstructs_image_tokens(name: str, smoke_cfg: dict[str, Any], tiny_tokenizer_dir: Path,
                                                tiny_corpus_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 pairs every image token's embedding with its own pixel block, lowers the reconstruction loss, and
    ``freeze_encoder`` keeps the encoder (not the projector) fixed through the LM stage."""
    from transformers import AutoTokenizer

    import specprefetch.models.pretrain as pretrain
    from specprefetch.data.workloads import read_workload
    from specprefetch.models.loading import encode_sample, load_image
    from specprefetch.models.pretrain import image_token_embeddings, pixel_targets, vision_encoder_params, vision_stage

    cfg = copy.deepcopy(smoke_cfg)
    s = build_stand_in(cfg, name, AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    bundle = pretrain._bundle(name, cfg["models"][name], s)
    samples = read_workload(tiny_corpus_dir)
    with_image = [x for x in samples if getattr(x, "image", None)][:2]
    px = pretrain._pixels(bundle, [load_image(x, tiny_corpus_dir) for x in with_image])
    with torch.no_grad():
        emb = image_token_embeddings(bundle, px)
    n_tokens = int(encode_sample(bundle, with_image[0], tiny_corpus_dir).is_image.sum())
    assert emb.shape[0] == pixel_targets(bundle, px).shape[0] == 2 * n_tokens
    curve = vision_stage(bundle, samples, tiny_corpus_dir, {"steps": 6, "batch_size": 4, "lr": 5e-3}, 0)
    assert len(curve) == 6 and curve[-1]["recon_loss"] < curve[0]["recon_loss"]

    after_stage: dict[str, list[torch.Tensor]] = {}

    def recording_stage(b: ModelBundle, *args: Any) -> Any:
        out = vision_stage(b, *args)
        after_stage["encoder"] = [p.detach().clone() for p in vision_encoder_params(b)]
        after_stage["projector"] = [p.detach().clone() for p in pretrain.vision_params(b)]
        return out

    monkeypatch.setattr(pretrain, "vision_stage", recording_stage)
    pcfg = cfg["models"][name]["pretrain"]
    pcfg.update(steps=2, batch_size=4, seq_len=64, lr=5e-3, warmup_steps=1,
                vision={"steps": 2, "batch_size": 4, "lr": 5e-3, "freeze_encoder": True})
    log = pretrain.pretrain_stand_in(cfg, name, tiny_corpus_dir, tiny_tokenizer_dir, tmp_path / "m")
    assert len(log["vision_curve"]) == 2 and log["vision_wall_s"] >= 0
    trained = load_bundle(cfg, name, tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(after_stage["encoder"], vision_encoder_params(trained), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after_stage["projector"], pretrain.vision_params(trained),
                                                        strict=True))
