"""Predictors: interface, parameter counts, training-free methods against hand computations, KL training
(loss goes down, deterministic), save/load round trips, online training on a tiny model."""

from __future__ import annotations

import copy
import json
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from specprefetch.config import load_config
from specprefetch.io import SpecPrefetchError
from specprefetch.predictors import METHODS, PredictorDims, PredictorError, build_predictor, load_predictor
from specprefetch.predictors.base import multi_hot
from specprefetch.predictors.data import TraceChunks, chunk_spans, iter_trace_batches
from specprefetch.predictors.train import next_layer_kl, train_predictor
from specprefetch.traces.store import TraceReader, TraceWriter

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-qwen3-vl-moe"  # smoke profile: L=3 MoE layers, D=32, n=16, K=4


# --------------------------------------------------------------------------------------------- fixtures


def make_trace(out: Path, workload: str = "corpus", n_samples: int = 40, L: int = 3, D: int = 32, n: int = 16,
               K: int = 4, seed: int = 0, shard_tokens: int = 256, vocab: int = 200,
               pre_attention: bool = False, sample_seed: int | None = None) -> Path:
    """A synthetic trace in the contract's format: a residual stream drifting across layers (so the next
    gate on the current input is informative, like in a real MoE), random gates, true top-K routing. With
    ``pre_attention`` each layer's stream before a synthetic attention update is stored too (``pre``): the router
    input is that stream after the update, so ``pre`` predicts the layer's routing well but not exactly."""
    g = torch.Generator().manual_seed(seed)
    gates = [torch.randn(n, D, generator=g) * 3 / D**0.5 for _ in range(L)]
    drift = [torch.randn(D, D, generator=g) * 0.5 / D**0.5 for _ in range(L)]
    attn = [torch.randn(D, D, generator=g) * 0.3 / D**0.5 for _ in range(L)]
    emb = torch.randn(vocab, D, generator=g)
    meta = {"model": MODEL, "workload": workload, "arch": "qwen3_vl_moe", "n_experts": n, "top_k": K,
            "hidden_size": D, "moe_layers": list(range(L)), "scoring": "softmax",
            "routers": {f"gate.{i}.weight": gates[i] for i in range(L)}}
    # samples differ by seed (or sample_seed: other samples of the same model), gates are the model's
    g = torch.Generator().manual_seed(seed + 1000 if sample_seed is None else sample_seed)
    with TraceWriter(out, meta, shard_tokens=shard_tokens, pre_attention=pre_attention) as w:
        for _ in range(n_samples):
            t = int(torch.randint(8, 40, (1,), generator=g))
            ids = torch.randint(0, vocab, (t,), generator=g)
            h = emb[ids] + 0.3 * torch.randn(t, D, generator=g)
            xs, lg, tk, pre = [], [], [], []
            for l in range(L):
                if pre_attention:
                    pre.append(h / h.norm(dim=-1, keepdim=True) * D**0.5)
                    h = h + torch.tanh(h @ attn[l]) + 0.1 * torch.randn(t, D, generator=g)
                x = h / h.norm(dim=-1, keepdim=True) * D**0.5
                z = x @ gates[l].T
                xs.append(x)
                lg.append(z)
                tk.append(z.topk(K).indices)
                h = h + torch.tanh(h @ drift[l]) + 0.2 * torch.randn(t, D, generator=g)
            w.add_sample(xs, lg, tk, ids, torch.arange(t), torch.zeros(t, dtype=torch.uint8),
                         (torch.arange(t) < t // 2).to(torch.uint8), pre=pre if pre_attention else None)
    return out


@pytest.fixture(scope="module")
def cfg() -> dict:
    c = load_config(REPO / "config" / "smoke.yaml")
    c = copy.deepcopy(c)
    c["predictors"]["training"]["batch_tokens"] = 64
    c["predictors"]["training"]["lr"] = 1e-2
    c["predictors"]["draft_model"] = {"num_layers": 1, "d_model": 32, "num_heads": 2}  # fast tests
    return c


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trace(tmp_path_factory.mktemp("tr") / "corpus", n_samples=40)


@pytest.fixture(scope="module")
def batch(corpus: Path) -> dict:
    """The corpus' tokens in one batch; the router inputs stand in for the pre-attention inputs (``pre``), the
    pre_attention method's input."""
    b = next(iter_trace_batches(TraceReader(corpus), 10_000))
    return {**b, "pre": [x.clone() for x in b["x"]]}


DIMS = PredictorDims(n_layers=3, hidden_size=32, n_experts=16, top_k=4, vocab_size=200)


# --------------------------------------------------------------------------------------------- interface


@pytest.mark.parametrize(("L", "D", "n", "r"), [(3, 32, 16, 16), (8, 128, 128, 16), (11, 128, 64, 4), (2, 7, 5, 1)])
def test_specprefetch_param_count(L: int, D: int, n: int, r: int) -> None:
    p = build_predictor("specprefetch", {"specprefetch": {"rank": r}}, PredictorDims(L, D, n, 2))
    assert p.trainable_params() == (L - 1) * r * (D + n)


def test_param_counts_are_counted_not_assumed() -> None:
    d = PredictorDims(4, 32, 16, 4, vocab_size=50)
    promoe = build_predictor("promoe", {"promoe": {"hidden": None}}, d)
    assert promoe.trainable_params() == 3 * (32 * 32 + 32 + 32 * 16 + 16)  # hidden = D
    single = build_predictor("single_mlp", {"single_mlp": {"hidden": 8}}, d)
    assert single.trainable_params() == 32 * 8 + 8 + 3 * 8 + 8 * 16 + 16
    for m in ("fate", "previous_token", "frequency", "oracle"):
        assert build_predictor(m, None, d).trainable_params() == 0
    draft = build_predictor("draft_model", {"draft_model": {"num_layers": 1, "d_model": 16, "num_heads": 2}}, d)
    draft.embed.weight.requires_grad_(False)  # frozen parameters are not counted
    assert draft.trainable_params() == sum(p.numel() for n_, p in draft.named_parameters() if n_ != "embed.weight")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_predicts_next_layers(method: str, batch: dict) -> None:
    p = build_predictor(method, None, DIMS)
    t = batch["token_ids"].shape[0]
    out = p(batch)
    assert len(out) == 2 and all(o.shape == (t, 16) for o in out)
    tok = p.priorities(batch, "token")
    agg = p.priorities(batch, "batch")
    assert all(a.shape == (16,) for a in agg)
    for a, s in zip(agg, tok):
        torch.testing.assert_close(a.double(), s.double().sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(PredictorError):
        p.priorities(batch, "layer")  # type: ignore[arg-type]


def test_unknown_method_and_bad_dims() -> None:
    with pytest.raises(PredictorError, match="unknown predictor method 'lstm'"):
        build_predictor("lstm", None, DIMS)
    with pytest.raises(PredictorError, match="n_layers=1"):
        PredictorDims(1, 8, 4, 2)
    with pytest.raises(PredictorError, match="vocab_size"):
        build_predictor("draft_model", None, PredictorDims(3, 8, 4, 2))


# --------------------------------------------------------------------------------------------- training-free methods


def test_previous_token_matches_loop(batch: dict) -> None:
    p = build_predictor("previous_token", None, DIMS)
    scores = p.priorities(batch, "token")
    sidx = batch["sample_index"].tolist()
    for l in range(2):
        top = batch["topk"][l + 1].tolist()
        expect = torch.zeros(len(sidx), 16)
        for t in range(len(sidx)):
            if t > 0 and sidx[t] == sidx[t - 1]:
                for e in top[t - 1]:
                    expect[t, e] = 1.0
        torch.testing.assert_close(scores[l], expect)


def test_previous_token_rejects_shuffled_batch(corpus: Path) -> None:
    shuffled = next(TraceReader(corpus).iter_batches(200, shuffle=True, seed=3))
    with pytest.raises(PredictorError, match="contiguous"):
        build_predictor("previous_token", None, DIMS)(shuffled)


def test_frequency_counts_corpus(corpus: Path, batch: dict) -> None:
    p = build_predictor("frequency", None, DIMS)
    reader = TraceReader(corpus)
    p.fit_statistics(reader)
    counts = torch.zeros(2, 16, dtype=torch.float64)
    for shard in reader.iter_shards():
        for l in range(2):
            for e in shard[f"topk.{l + 1}"].flatten().tolist():
                counts[l, e] += 1
    torch.testing.assert_close(p.counts, counts)
    s = p.priorities(batch, "token")[0]
    assert torch.equal(s[0], s[-1]) and abs(float(s[0].sum()) - 1) < 1e-6


def test_fate_on_tiny_qwen3_moe() -> None:
    """FATE = next layer's native gate on this layer's router input, checked on a real HF MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from specprefetch.models.capture import RouterCapture
    from specprefetch.models.routing import discover_routing

    torch.manual_seed(0)
    conf = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(conf).eval()
    spec = discover_routing(model)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad(), RouterCapture(model, spec) as cap:
        model(input_ids=ids)
        xs = cap.inputs()
    gates = [layer.mlp.gate.weight.detach() for layer in model.model.layers]
    dims = PredictorDims(n_layers=3, hidden_size=32, n_experts=8, top_k=2)
    fate = build_predictor("fate", None, dims)
    fate.set_gates(spec.router_tensors())
    b = {"x": xs, "logits": [x @ g.T for x, g in zip(xs, gates)], "topk": [torch.zeros(12, 2, dtype=torch.long)] * 3,
         "token_ids": ids[0], "sample_index": torch.zeros(12, dtype=torch.long), "position": torch.arange(12)}
    out = fate(b)
    for l in range(2):
        by_hand = xs[l].float() @ gates[l + 1].float().T
        torch.testing.assert_close(out[l], by_hand, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fate.priorities(b)[l], F.softmax(by_hand, -1), rtol=1e-5, atol=1e-6)
    assert fate.trainable_params() == 0


def test_fate_sigmoid_scoring_uses_correction_bias() -> None:
    dims = PredictorDims(n_layers=2, hidden_size=4, n_experts=3, top_k=1, scoring="sigmoid")
    fate = build_predictor("fate", None, dims)
    w = torch.randn(3, 4)
    bias = torch.tensor([0.0, 5.0, 0.0])
    fate.set_gates({"gate.0.weight": w, "gate.1.weight": w, "gate.1.e_score_correction_bias": bias})
    x = torch.randn(5, 4)
    b = {"x": [x, x], "token_ids": torch.zeros(5, dtype=torch.long)}
    torch.testing.assert_close(fate.priorities(b)[0], torch.sigmoid(x @ w.T) + bias)


def test_oracle_scores_rank_true_experts_first(batch: dict) -> None:
    p = build_predictor("oracle", None, DIMS)
    s = p.priorities(batch)[0]
    top = s.topk(4).indices.sort().values
    assert torch.equal(top, batch["topk"][1].long().sort().values)


def test_draft_model_is_causal(batch: dict) -> None:
    torch.manual_seed(0)
    p = build_predictor("draft_model", {"draft_model": {"num_layers": 2, "d_model": 16, "num_heads": 2}}, DIMS).eval()
    first = int((batch["sample_index"] == batch["sample_index"][0]).sum())
    b2 = dict(batch)
    ids = batch["token_ids"].clone()
    ids[first - 1] = (ids[first - 1] + 1) % 200  # change the last token of the first sample
    b2["token_ids"] = ids
    with torch.no_grad():
        a, b = p(batch), p(b2)
    for l in range(2):
        torch.testing.assert_close(a[l][: first - 1], b[l][: first - 1])  # earlier tokens: unchanged
        assert not torch.allclose(a[l][first - 1], b[l][first - 1])
        torch.testing.assert_close(a[l][first:], b[l][first:])  # other samples: unchanged
    # out-of-vocabulary ids fall into the unknown row instead of failing
    b2["token_ids"] = ids + 10_000
    assert p(b2)[0].isfinite().all()


def test_draft_model_embedding_init_from_model_dir(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from specprefetch.predictors.draft_model import find_input_embeddings

    table = torch.randn(50, 24)
    save_file({"model.language_model.embed_tokens.weight": table, "lm_head.weight": torch.randn(50, 24)},
              str(tmp_path / "model.safetensors"))
    found = find_input_embeddings(tmp_path)
    assert torch.equal(found, table)
    p = build_predictor("draft_model", {"draft_model": {"num_layers": 1, "d_model": 8, "num_heads": 2}},
                        PredictorDims(3, 24, 16, 4, vocab_size=50))
    p.init_embeddings(found)
    # PCA projection: the embedding keeps the table's geometry (rows stay distinguishable, unit scale)
    emb = p.embed.weight[:50].detach()
    assert abs(float(emb.std()) - 1.0) < 1e-3
    assert find_input_embeddings(tmp_path / "nothing-here") is None


# --------------------------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("method", METHODS)
def test_save_load_roundtrip(method: str, batch: dict, corpus: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    p = build_predictor(method, {"draft_model": {"num_layers": 1, "d_model": 16, "num_heads": 2}}, DIMS)
    p.fit_statistics(TraceReader(corpus))
    for prm in p.parameters():  # make weights non-trivial (B starts at zero)
        torch.nn.init.normal_(prm.data)
    p.save(tmp_path / method, extra_meta={"model": MODEL})
    q = load_predictor(tmp_path / method)
    assert type(q) is type(p) and q.trainable_params() == p.trainable_params()
    with torch.no_grad():
        for a, b in zip(p.eval().priorities(batch), q.priorities(batch)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    meta = json.loads((tmp_path / method / "meta.json").read_text())
    assert meta["method"] == method and meta["model"] == MODEL


def test_load_rejects_corrupt_or_mismatched(tmp_path: Path) -> None:
    p = build_predictor("specprefetch", None, DIMS)
    p.save(tmp_path / "p")
    w = tmp_path / "p" / "predictor.safetensors"
    blob = bytearray(w.read_bytes())
    blob[-1] ^= 0xFF
    w.write_bytes(bytes(blob))
    with pytest.raises(PredictorError, match="predictor.safetensors: sha256"):
        load_predictor(tmp_path / "p")
    with pytest.raises(PredictorError, match="meta.json: missing"):
        load_predictor(tmp_path / "absent")
    # weights of another shape than meta.json says
    q = build_predictor("specprefetch", {"specprefetch": {"rank": 2}}, DIMS)
    q.save(tmp_path / "q")
    meta = json.loads((tmp_path / "q" / "meta.json").read_text())
    meta["method_cfg"]["rank"] = 3
    (tmp_path / "q" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="does not fit"):
        load_predictor(tmp_path / "q")


# --------------------------------------------------------------------------------------------- training


def test_chunks_hold_whole_samples(corpus: Path) -> None:
    sidx = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3])
    assert chunk_spans(sidx, 5) == [(0, 5), (5, 6), (6, 11)]
    ds = TraceChunks(TraceReader(corpus), 64, seed=0)
    seen = []
    for b in ds:
        assert b["token_ids"].shape[0] <= 64 or torch.unique(b["sample_index"]).numel() == 1
        seen += torch.unique(b["sample_index"]).tolist()
    assert sorted(seen) == list(range(40))  # every sample exactly once, never split
    order = [tuple(torch.unique(b["sample_index"]).tolist()) for b in ds]
    ds.set_epoch(1)
    assert order != [tuple(torch.unique(b["sample_index"]).tolist()) for b in ds]


def test_kl_loss_zero_for_perfect_prediction(batch: dict) -> None:
    preds = [batch["logits"][l + 1] + 3.0 for l in range(2)]  # shift-invariant softmax
    assert float(next_layer_kl(preds, batch["logits"])) < 1e-6
    assert float(next_layer_kl([torch.zeros_like(p) for p in preds], batch["logits"])) > 0.1


def _kl_on(pred_dir: Path, corpus: Path) -> float:
    p = load_predictor(pred_dir)
    with torch.no_grad():
        losses = [float(next_layer_kl(p(b), b["logits"])) for b in iter_trace_batches(TraceReader(corpus), 10_000)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("method", ["specprefetch", "single_mlp", "promoe", "draft_model"])
def test_training_lowers_kl(method: str, cfg: dict, corpus: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    init = build_predictor(method, cfg, PredictorDims.from_manifest(TraceReader(corpus).manifest, vocab_size=200))
    with torch.no_grad():
        before = sum(float(next_layer_kl(init(b), b["logits"]))
                     for b in iter_trace_batches(TraceReader(corpus), 10_000))
    meta = train_predictor(cfg, MODEL, method, corpus, tmp_path / method)
    after = _kl_on(tmp_path / method, corpus)
    assert after < 0.9 * before, (before, after)
    assert meta["trainable_params"] == load_predictor(tmp_path / method).trainable_params()
    assert len(meta["loss_curve"]) == meta["training"]["steps"] > 5
    assert meta["final_loss"] < meta["loss_curve"][0]
    saved = json.loads((tmp_path / method / "meta.json").read_text())
    assert saved["provenance"]["seed"] == cfg["predictors"]["training"]["seed"]
    assert saved["trained_on"]["n_tokens"] == TraceReader(corpus).n_tokens
    assert not list(tmp_path.glob(".*.tmp"))  # atomic: no leftovers


def test_training_is_deterministic(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    for run in ("a", "b"):
        train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / run)
    a = (tmp_path / "a" / "predictor.safetensors").read_bytes()
    b = (tmp_path / "b" / "predictor.safetensors").read_bytes()
    assert a == b
    other = copy.deepcopy(cfg)
    other["predictors"]["training"]["seed"] = 1
    train_predictor(other, MODEL, "specprefetch", corpus, tmp_path / "c")
    assert (tmp_path / "c" / "predictor.safetensors").read_bytes() != a


def test_preempted_training_resumes_from_its_checkpoint(cfg: dict, corpus: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job killed mid-training leaves no output but a checkpoint beside it; the rerun resumes there and ends
    with the weights of an uninterrupted run."""
    from transformers import TrainerCallback

    import specprefetch.predictors.train as train_mod

    cfg = copy.deepcopy(cfg)
    cfg["predictors"]["training"]["checkpoint_steps"] = 3
    train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "whole")
    assert not (tmp_path / ".whole.checkpoints").exists()  # removed after success

    class Preempt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if state.global_step == 5:
                raise KeyboardInterrupt("preempted")  # after checkpoint-3, before checkpoint-6

    make = train_mod._make_trainer

    def preempted(*a, **kw):  # noqa: ANN002, ANN003
        trainer = make(*a, **kw)
        trainer.add_callback(Preempt())
        return trainer

    monkeypatch.setattr(train_mod, "_make_trainer", preempted)
    with pytest.raises(KeyboardInterrupt):
        train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "job")
    assert not (tmp_path / "job").exists()
    assert (tmp_path / ".job.checkpoints" / "checkpoint-3" / "trainer_state.json").is_file()
    monkeypatch.setattr(train_mod, "_make_trainer", make)
    meta = train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "job")
    assert meta["training"]["resumed_from_step"] == 3
    assert not (tmp_path / ".job.checkpoints").exists()
    a, b = load_predictor(tmp_path / "whole"), load_predictor(tmp_path / "job")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    # a checkpoint of another configuration is never resumed
    cfg["predictors"]["training"]["lr"] = 5e-3
    monkeypatch.setattr(train_mod, "_make_trainer", preempted)
    with pytest.raises(KeyboardInterrupt):
        train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "job2")
    monkeypatch.setattr(train_mod, "_make_trainer", make)
    cfg["predictors"]["training"]["lr"] = 1e-2
    retrained = train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "job2")
    assert retrained["training"]["resumed_from_step"] is None


@pytest.mark.parametrize("method", ["fate", "frequency", "previous_token", "oracle"])
def test_training_free_methods_just_save(method: str, cfg: dict, corpus: Path, tmp_path: Path) -> None:
    meta = train_predictor(cfg, MODEL, method, corpus, tmp_path / method)
    assert meta["trainable_params"] == 0 and meta["final_loss"] is None
    p = load_predictor(tmp_path / method)
    if method == "fate":
        torch.testing.assert_close(p.weight[0], TraceReader(corpus).gate_weights()[1])


def test_train_rejects_bad_input(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecPrefetchError, match="unknown predictor method"):
        train_predictor(cfg, MODEL, "lstm", corpus, tmp_path / "x")
    with pytest.raises(SpecPrefetchError, match="tiny-deepseek-vl2"):
        train_predictor(cfg, "tiny-deepseek-vl2", "fate", corpus, tmp_path / "x")  # trace of another model
    with pytest.raises(SpecPrefetchError, match="manifest.json: missing"):
        train_predictor(cfg, MODEL, "fate", tmp_path / "nope", tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------- online source


@pytest.fixture(scope="module")
def stand_in_dir(tmp_path_factory: pytest.TempPathFactory, smoke_cfg: dict, tiny_tokenizer: object) -> Path:
    from specprefetch.models.standins import build_stand_in, save_stand_in

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("model") / MODEL
    save_stand_in(build_stand_in(smoke_cfg, MODEL, tiny_tokenizer), out)
    return out


def _param_digest(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def test_online_training_keeps_model_frozen(smoke_cfg: dict, stand_in_dir: Path, tiny_corpus_dir: Path,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import specprefetch.models as models
    from specprefetch.data.workloads import read_workload
    from specprefetch.predictors.data import OnlineChunks
    from specprefetch.traces.extract import extract_traces

    cfg = copy.deepcopy(smoke_cfg)
    cfg["predictors"]["training"].update(source="online", batch_tokens=128, lr=1e-2)
    bundle = models.load_bundle(cfg, MODEL, stand_in_dir)
    before = _param_digest(bundle.model)
    monkeypatch.setattr(models, "load_bundle", lambda *a, **k: bundle)  # hold the very model that is used
    meta = train_predictor(cfg, MODEL, "specprefetch", None, tmp_path / "online", model_dir=stand_in_dir,
                           corpus_dir=tiny_corpus_dir)
    assert _param_digest(bundle.model) == before
    assert all(not p.requires_grad and p.grad is None for p in bundle.model.parameters())
    assert meta["training"]["source"] == "online" and meta["training"]["steps"] >= 3
    assert meta["final_loss"] < meta["loss_curve"][0]
    assert load_predictor(tmp_path / "online").trainable_params() == 2 * 16 * (32 + 16)
    # the online stream routes each sample exactly as trace extraction stores it
    trace = extract_traces(cfg, MODEL, stand_in_dir, tiny_corpus_dir, tmp_path / "trace")
    assert trace["n_tokens"] > 0
    stream = OnlineChunks(bundle, read_workload(tiny_corpus_dir), tiny_corpus_dir, 128, cfg["traces"], shuffle=False)
    first = stream.materialize([stream.chunks[0]])
    stored = next(iter_trace_batches(TraceReader(tmp_path / "trace"), first["token_ids"].shape[0]))
    for key in ("token_ids", "sample_index", "position", "is_image", "is_prompt"):
        assert torch.equal(first[key].to(stored[key].dtype), stored[key]), key
    for key in ("x", "logits", "topk"):
        for a, b in zip(first[key], stored[key]):
            assert torch.equal(a.to(b.dtype), b), key
    # training-free methods can fit from the live model too (no traces)
    fate = train_predictor(cfg, MODEL, "fate", None, tmp_path / "fate", model_dir=stand_in_dir,
                           corpus_dir=tiny_corpus_dir)
    assert fate["training"]["source"] == "online"
    torch.testing.assert_close(load_predictor(tmp_path / "fate").weight[0],
                               TraceReader(tmp_path / "trace").gate_weights()[1])
    with pytest.raises(SpecPrefetchError, match="--corpus"):
        train_predictor(cfg, MODEL, "specprefetch", None, tmp_path / "x", model_dir=stand_in_dir)


def test_draft_model_takes_embeddings_from_model_dir(cfg: dict, corpus: Path, stand_in_dir: Path,
                                                     tmp_path: Path) -> None:
    from specprefetch.predictors.draft_model import find_input_embeddings, project_embeddings

    small = copy.deepcopy(cfg)
    small["predictors"]["training"]["epochs"] = 0.01  # one step: the embedding barely moves
    small["predictors"]["training"]["lr"] = 1e-6
    meta = train_predictor(small, MODEL, "draft_model", corpus, tmp_path / "d", model_dir=stand_in_dir)
    table = find_input_embeddings(stand_in_dir)
    assert meta["dims"]["vocab_size"] == max(table.shape[0], 1024)  # model rows vs the smoke tokenizer size
    emb = load_predictor(tmp_path / "d").embed.weight[: table.shape[0]]
    torch.testing.assert_close(emb, project_embeddings(table.float(), 32), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["single_mlp", "promoe"])
def test_layer_token_scores_match_batch_priorities(method: str, batch: dict) -> None:
    """The per-layer run-time API gives the same π̂ as the batch API."""
    p = build_predictor(method, None, DIMS).eval()
    with torch.no_grad():
        full = p.priorities(batch)
        for l in range(2):
            torch.testing.assert_close(p.layer_token_scores(l, batch["x"][l]), full[l])


def test_multi_process_training_with_torchrun(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    """predictors.training.launcher: torchrun starts 2 processes (gloo on CPU); the Trainer splits the data, DDP
    averages the gradients, rank 0 alone writes the predictor."""
    import os
    import subprocess
    import sys

    import yaml

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = tmp_path / "ddp"
    res = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "specprefetch",
                          "train-predictor", "--config", str(cfg_path), "--model", MODEL, "--method", "specprefetch",
                          "--traces", str(corpus), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    chunks = TraceChunks(TraceReader(corpus), cfg["predictors"]["training"]["batch_tokens"], seed=0).n_chunks
    assert meta["training"]["world_size"] == 2 and meta["training"]["steps"] == -(-chunks // 2)
    assert load_predictor(out).trainable_params() == meta["trainable_params"]
    assert (res.stdout + res.stderr).count("saved specprefetch predictor") == 1  # rank 0 writes, rank 1 does not
    assert not list(tmp_path.glob(".ddp*"))  # no temporaries or checkpoints left behind


# --------------------------------------------------------------------------------------------- precision, DeepSpeed


def test_cpu_bf16_is_autocast(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    """precision bf16 on CPU trains under torch's CPU autocast (bf16 matmuls, fp32 weights); auto stays fp32."""
    from specprefetch.predictors.train import resolve_precision

    assert resolve_precision("bf16") == "bf16" and resolve_precision("auto") == "fp32"  # no CUDA in this test
    bf16 = copy.deepcopy(cfg)
    bf16["predictors"]["training"].update(precision="bf16", epochs=0.2)
    meta = train_predictor(bf16, MODEL, "specprefetch", corpus, tmp_path / "bf16")
    assert meta["training"]["precision"] == "bf16"
    assert meta["training"]["compute"] == {"autocast": True, "autocast_dtype": "bfloat16", "output_dtype": "bfloat16",
                                           "param_dtype": "float32", "device": "cpu"}
    assert load_predictor(tmp_path / "bf16").B.dtype == torch.float32
    assert meta["training"]["distributed"]["deepspeed"] is None
    fp32 = copy.deepcopy(bf16)
    fp32["predictors"]["training"]["precision"] = "fp32"
    meta = train_predictor(fp32, MODEL, "specprefetch", corpus, tmp_path / "fp32")
    assert meta["training"]["compute"]["autocast"] is False and meta["training"]["compute"]["output_dtype"] == "float32"


def test_deepspeed_settings_follow_the_training_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """config/deepspeed_zero2.json leaves the recipe to predictors.training ("auto"), precision fills its
    torch_autocast; a DeepSpeed scheduler or bf16-weights mode is refused; without a launcher it is ignored (one
    warning), under one a missing deepspeed is one clear error."""
    import importlib.util

    import specprefetch.predictors.train as train_mod
    from specprefetch.predictors.train import deepspeed_config_path, deepspeed_settings

    path = REPO / "config" / "deepspeed_zero2.json"
    raw = json.loads(path.read_text())
    assert raw["zero_optimization"]["stage"] == 2 and "scheduler" not in raw
    assert raw["optimizer"]["params"] == {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                          "torch_adam": True}
    assert all(raw[k] == "auto" for k in ("gradient_clipping", "gradient_accumulation_steps",
                                          "train_micro_batch_size_per_gpu", "train_batch_size"))
    assert deepspeed_settings(path, "bf16")["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert deepspeed_settings(path, "fp32")["torch_autocast"]["enabled"] is False
    assert deepspeed_settings(path, "bf16")["bf16"] == {"enabled": False}
    for bad, match in ((dict(raw, scheduler={"type": "WarmupCosineLR"}), "scheduler"),
                       (dict(raw, bf16={"enabled": True}), "bf16.enabled"),
                       (dict(raw, torch_autocast={"enabled": False}), "torch_autocast.enabled")):
        (tmp_path / "ds.json").write_text(json.dumps(bad))
        with pytest.raises(SpecPrefetchError, match=match):
            deepspeed_settings(tmp_path / "ds.json", "bf16")
    tcfg = {"deepspeed_config": "config/deepspeed_zero2.json"}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with caplog.at_level("WARNING", logger=train_mod.__name__):
        assert deepspeed_config_path(tcfg) is None
    assert "not started by a distributed launcher" in caplog.text
    monkeypatch.setenv("LOCAL_RANK", "0")
    if importlib.util.find_spec("deepspeed") is not None:
        assert deepspeed_config_path(tcfg) == path
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(SpecPrefetchError, match=r"pip install 'specprefetch\[deepspeed\]'"):
        deepspeed_config_path(tcfg)


def test_deepspeed_zero2_online_training_over_gloo(smoke_cfg: dict, stand_in_dir: Path, tiny_corpus_dir: Path,
                                                   tmp_path: Path) -> None:
    """The paper's recipe (config/paper.yaml predictors.training: online, AdamW lr 1e-4, cosine with 3 % warmup,
    clipping 0.5, bf16, DeepSpeed ZeRO-2 from config/deepspeed_zero2.json) on CPU: two torchrun processes, ZeRO-2
    over gloo, bf16 autocast; rank 0 writes a predictor that loads back, equal on both ranks and better than init."""
    import importlib.util
    import math
    import os
    import subprocess
    import sys

    import yaml
    from transformers import get_cosine_schedule_with_warmup

    from specprefetch.predictors.train import state_digest
    from specprefetch.traces.extract import extract_traces

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (the deepspeed extra: pip install 'specprefetch[deepspeed]')")
    paper = load_config(REPO / "config" / "paper.yaml")["predictors"]["training"]
    assert (paper["source"], paper["precision"], paper["deepspeed_config"]) == (
        "online", "bf16", "config/deepspeed_zero2.json")
    cfg = copy.deepcopy(smoke_cfg)
    recipe = {k: paper[k] for k in ("source", "epochs", "lr", "betas", "eps", "weight_decay", "scheduler",
                                    "warmup_ratio", "max_grad_norm", "precision", "seed", "deepspeed_config")}
    # the tiny corpus in several batches; one DeepSpeed checkpoint on the way (removed after success)
    cfg["predictors"]["training"].update(recipe, batch_tokens=128, checkpoint_steps=4)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = tmp_path / "zero2"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "specprefetch", "train-predictor", "--config", str(cfg_path), "--model", MODEL,
                          "--method", "specprefetch", "--model-dir", str(stand_in_dir), "--corpus",
                          str(tiny_corpus_dir), "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert log.count("saved specprefetch predictor") == 1  # rank 0 writes, rank 1 does not
    assert not list(tmp_path.glob(".zero2*"))  # no temporaries, and the checkpoints are removed after success
    meta = json.loads((out / "meta.json").read_text())
    t = meta["training"]
    steps = t["steps"]
    assert t["source"] == "online" and t["precision"] == "bf16" and t["world_size"] == 2 and steps >= 4
    # bf16 is autocast on CPU: bf16 compute, fp32 weights (DeepSpeed's torch_autocast, not its bf16 weights)
    assert t["compute"] == {"autocast": True, "autocast_dtype": "bfloat16", "output_dtype": "bfloat16",
                            "param_dtype": "float32", "device": "cpu"}
    d = t["distributed"]
    ds = d["deepspeed"]
    assert d["backend"] == "gloo" and ds["zero_stage"] == 2 and ds["config"].endswith("config/deepspeed_zero2.json")
    assert ds["torch_autocast"] and ds["torch_autocast_dtype"] == "bfloat16" and not ds["bf16_weights"]
    assert ds["accelerator"] == "CPU_Accelerator"
    # the recipe is what DeepSpeed ran: its optimizer, hyper-parameters, clipping and batch sizes read back
    assert ds["optimizer"] == "DeepSpeedZeroOptimizer" and ds["base_optimizer"] == "torch.optim.adamw.AdamW"
    assert ds["optimizer_hparams"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert ds["gradient_clipping"] == 0.5
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (1, 2)
    # ZeRO-2 partitions the optimizer state: each rank holds about half of Adam's moments
    held, n = ds["optimizer_state_numel_by_rank"], ds["trainable_numel"]
    assert n == meta["trainable_params"] and n <= sum(held) < n + 64 and all(h <= n // 2 + 32 for h in held), held
    # the schedule is the Trainer's cosine with 3 % linear warmup at lr 1e-4, step by step
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=paper["lr"])
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(paper["warmup_ratio"] * steps), steps)
    expected = []
    for _ in range(steps):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert len(t["lr_curve"]) == len(meta["loss_curve"]) == steps
    assert t["lr_curve"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    # both ranks end with the same weights, and those are what was saved; it loads back, trained
    p = load_predictor(out)
    assert len(d["param_sha256_by_rank"]) == 2 and set(d["param_sha256_by_rank"]) == {state_digest(p)}
    assert p.trainable_params() == meta["trainable_params"] and p.B.dtype == torch.float32
    assert p.B.abs().max() > 0  # B starts at zero (uniform prediction): training moved it
    trace = tmp_path / "trace"
    extract_traces(cfg, MODEL, stand_in_dir, tiny_corpus_dir, trace)
    init = load_predictor(out)
    with torch.no_grad():
        init.B.zero_()  # the initial predictor's output (B = 0: uniform over the experts)
    batches = list(iter_trace_batches(TraceReader(trace), 10_000))
    with torch.no_grad():
        trained_kl = sum(float(next_layer_kl(p(b), b["logits"])) for b in batches)
        init_kl = sum(float(next_layer_kl(init(b), b["logits"])) for b in batches)
    assert trained_kl < init_kl, (trained_kl, init_kl)


# --------------------------------------------------------------------------------------------- prediction cost


def test_prediction_cost_of_trained_predictors(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    """measure-predictor-cost times the saved predictors against one MoE layer of the model's shape: one row per
    live method (the oracle skipped), their own parameter counts, ratios with a CI, the contract checked."""
    from specprefetch.contracts import check_csv
    from specprefetch.predictors.cost import measure_predictor_cost, write_predictor_cost

    dirs = []
    for method in ("specprefetch", "fate", "frequency", "oracle"):
        torch.manual_seed(0)
        p = build_predictor(method, cfg, DIMS)
        p.fit_statistics(TraceReader(corpus))
        dirs.append(p.save(tmp_path / method, extra_meta={"model": MODEL, "trainable_params": p.trainable_params()}))
    rows = measure_predictor_cost(cfg, dirs, rounds=3, reps=2)
    assert [r["method"] for r in rows] == ["specprefetch", "fate", "frequency"]
    assert rows[0]["trainable_params"] == build_predictor("specprefetch", cfg, DIMS).trainable_params() > 0
    for r in rows:
        assert r["model"] == MODEL and r["rounds"] == 3 and r["layer_us"] > 0 and r["predict_us"] > 0
        assert 0 <= r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"]
    out = tmp_path / "predictor_cost.csv"
    write_predictor_cost(rows, out)
    assert len(check_csv(out, "predictor_cost")) == 3
    bad = out.read_text().replace(",3\n", ",1\n", 1)  # one timing round: no CI
    (tmp_path / "bad.csv").write_text(bad)
    with pytest.raises(SpecPrefetchError, match="rounds"):
        check_csv(tmp_path / "bad.csv", "predictor_cost")
    with pytest.raises(SpecPrefetchError, match="not in the config"):
        measure_predictor_cost({**cfg, "models": {}}, dirs, rounds=3, reps=1)
    with pytest.raises(SpecPrefetchError, match="rounds 1 must be >= 2"):
        measure_predictor_cost(cfg, dirs, rounds=1, reps=1)
    with pytest.raises(SpecPrefetchError, match="a second fate"):
        measure_predictor_cost(cfg, [dirs[1], dirs[1]], rounds=2, reps=1)


# --------------------------------------------------------------------------------------------- look-ahead


@pytest.mark.parametrize("method", METHODS)
def test_every_method_predicts_d_layers_ahead(method: str, batch: dict) -> None:
    """At look-ahead d = 2 (L = 3) a predictor has one pair, (0, 2): FATE applies layer 2's gate to x^0, the oracle
    and Naive Prefetch read layer 2's routing; learned methods size their per-pair parts by L - d."""
    dims = PredictorDims(n_layers=3, hidden_size=32, n_experts=16, top_k=4, vocab_size=200, lookahead=2)
    assert dims.n_pairs == 1 and dims.target(0) == 2
    if method == "pre_attention":  # a layer from its own pre-attention input: no distance to look ahead
        with pytest.raises(PredictorError, match="no look-ahead"):
            build_predictor(method, None, dims)
        return
    p = build_predictor(method, None, dims)
    if method == "fate":
        p.set_gates({f"gate.{i}.weight": torch.full((16, 32), float(i)) for i in range(3)})
        assert float(p.weight[0, 0, 0]) == 2.0
    out = p(batch)
    assert len(out) == 1 and out[0].shape == (batch["token_ids"].shape[0], 16)
    if method == "oracle":
        torch.testing.assert_close(out[0], batch["logits"][2].float())


def test_lookahead_must_leave_a_pair() -> None:
    with pytest.raises(PredictorError, match="lookahead=3"):
        PredictorDims(3, 8, 4, 2, lookahead=3)
    with pytest.raises(PredictorError, match="lookahead=0"):
        PredictorDims(3, 8, 4, 2, lookahead=0)


def test_lookahead_training_and_recall(cfg: dict, corpus: Path, tmp_path: Path) -> None:
    """SpecPrefetch trained at d = 2 learns layer 2 from x^0 (its KL at d = 2 falls); evaluate_recall --by-lookahead
    scores it beside the d = 1 predictor on the pairs (l, l+d), FATE at d = 2 by hand; the paper's recall table
    refuses a look-ahead predictor; a distance with no pair is one line."""
    import pandas as pd

    from specprefetch.metrics import recall_per_token, select_candidates
    from specprefetch.predictors.evaluate import evaluate_recall, gather_recall

    reader = TraceReader(corpus)
    dims = dataclasses_replace(PredictorDims.from_manifest(reader.manifest), lookahead=2)
    torch.manual_seed(0)
    init = build_predictor("specprefetch", cfg, dims)
    meta = train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "sp.d2", lookahead=2)
    assert meta["dims"]["lookahead"] == 2 and meta["trainable_params"] == init.trainable_params()
    assert meta["provenance"]["cpu"]["model"] and meta["provenance"]["cpu"]["torch_capability"]  # where it was made
    trained = load_predictor(tmp_path / "sp.d2")
    with torch.no_grad():
        batches = list(iter_trace_batches(reader, 10_000))
        before = sum(float(next_layer_kl(init(b), b["logits"], 2)) for b in batches)
        after = sum(float(next_layer_kl(trained(b), b["logits"], 2)) for b in batches)
    assert after < 0.9 * before, (before, after)
    train_predictor(cfg, MODEL, "specprefetch", corpus, tmp_path / "sp")
    train_predictor(cfg, MODEL, "fate", corpus, tmp_path / "fate.d2", lookahead=2)

    wl = make_trace(tmp_path / "gsm8k", workload="gsm8k", n_samples=8, seed=5)
    pairs = [("specprefetch", tmp_path / "sp"), ("specprefetch", tmp_path / "sp.d2"), ("fate", tmp_path / "fate.d2")]
    df = evaluate_recall(cfg, MODEL, "gsm8k", wl, pairs, tmp_path / "ahead.csv", by_lookahead=True)
    assert set(zip(df["method"], df["lookahead"])) == {("specprefetch", 1), ("specprefetch", 2), ("fate", 2)}
    assert not (tmp_path / "ahead_per_layer.csv").exists()
    # FATE at d = 2 by hand: layer 2's gate (of the corpus trace it was built from) on x^0, top-K by softmax,
    # against layer 2's executed experts
    wr = TraceReader(wl)
    gate2 = reader.gate_weights()[2].float()
    hits = n = 0.0
    for b in iter_trace_batches(wr, 10_000):
        cand = select_candidates(F.softmax(F.linear(b["x"][0].float(), gate2), dim=-1), 4)
        hits += float(recall_per_token(b["topk"][2], cand).sum())
        n += b["token_ids"].shape[0]
    k = cfg["models"][MODEL]["top_k"]
    got = df[(df["method"] == "fate") & (df["M"] == k)]["expert_recall"].item()
    assert got == pytest.approx(hits / n, abs=1e-6)
    # d = 1 rows are the paper's recall of the same predictor
    plain = evaluate_recall(cfg, MODEL, "gsm8k", wl, pairs[:1], tmp_path / "plain.csv")
    one = df[(df["method"] == "specprefetch") & (df["lookahead"] == 1)].reset_index(drop=True)
    assert one["expert_recall"].tolist() == pytest.approx(plain["expert_recall"].tolist())
    gathered = gather_recall([tmp_path / "ahead.csv"], tmp_path / "lookahead.csv", by_lookahead=True)
    pd.testing.assert_frame_equal(gathered.sort_values(list(gathered.columns)).reset_index(drop=True),
                                  pd.read_csv(tmp_path / "lookahead.csv").sort_values(list(gathered.columns))
                                  .reset_index(drop=True), check_dtype=False)
    with pytest.raises(SpecPrefetchError, match="specprefetch/d2 .*more than one layer ahead"):
        evaluate_recall(cfg, MODEL, "gsm8k", wl, pairs[:2], tmp_path / "bad.csv")
    assert not (tmp_path / "bad.csv").exists()
    with pytest.raises(SpecPrefetchError, match="lookahead=3"):
        train_predictor(cfg, MODEL, "fate", corpus, tmp_path / "fate.d3", lookahead=3)
    assert not (tmp_path / "fate.d3").exists()


def test_runtime_provider_carries_the_predictors_distance() -> None:
    """A predictor trained at distance d gives the runtime a provider that prefetches d layers ahead (the runtime
    refuses one whose distance is not its own: tests/test_runtime.py); the paper's predictors are 1 ahead."""
    from specprefetch.runtime.core.priority import PredictorPriority

    dims = PredictorDims(n_layers=3, hidden_size=32, n_experts=16, top_k=4, lookahead=2)
    assert PredictorPriority(build_predictor("specprefetch", None, dims)).lookahead == 2
    assert PredictorPriority(build_predictor("specprefetch", None, DIMS)).lookahead == 1


# --------------------------------------------------------------------------------------------- pre-attention


def test_pre_attention_trains_on_the_pre_attention_input_and_beats_the_previous_layer(cfg: dict,
                                                                                       tmp_path: Path) -> None:
    """Beyond the paper: the pre-attention router reads layer l+1's own pre-attention input (``pre``), trains with the
    KL plus the pairwise ranking loss, has SpecPrefetch's parameters at one rank, and on a trace where layer l+1's
    pre-attention stream is closer to its router input than layer l's router input is, its recall beats
    SpecPrefetch's at the same budget."""
    from specprefetch.predictors.evaluate import evaluate_recall
    from specprefetch.predictors.pre_attention import pairwise_ranking_loss

    corpus = make_trace(tmp_path / "corpus", n_samples=60, pre_attention=True)
    evaluation = make_trace(tmp_path / "eval", workload="w", n_samples=20, sample_seed=7, pre_attention=True)
    reader = TraceReader(corpus)
    assert reader.has_pre_attention and TraceReader(evaluation).manifest["dtypes"]["pre"] == "bfloat16"
    batch = next(iter_trace_batches(reader, 10_000))
    assert len(batch["pre"]) == 3 and batch["pre"][1].shape == batch["x"][1].shape
    c = copy.deepcopy(cfg)
    c["predictors"]["pre_attention"] = {"rank": 16, "rank_loss_weight": 1.0}
    c["predictors"]["specprefetch"] = {"rank": 16}
    metas = {m: train_predictor(c, MODEL, m, corpus, tmp_path / m) for m in ("pre_attention", "specprefetch")}
    assert metas["pre_attention"]["trainable_params"] == metas["specprefetch"]["trainable_params"] == 2 * 16 * (32 + 16)
    assert metas["pre_attention"]["final_loss"] < metas["pre_attention"]["loss_curve"][0]
    pred = load_predictor(tmp_path / "pre_attention")
    assert pred.stage == "pre_attention" and pred.method_cfg == {"rank": 16, "rank_loss_weight": 1.0}
    with torch.no_grad():  # the loss is the KL plus the ranking term, which is > 0 unless every margin is huge
        z = pred(batch)
        rank = float(pairwise_ranking_loss(z, batch["topk"]))
        assert float(pred.loss(z, batch)) == pytest.approx(float(next_layer_kl(z, batch["logits"])) + rank, rel=1e-5)
        # a prediction that puts the executed experts far above the rest has (nearly) no ranking loss
        perfect = [multi_hot(batch["topk"][l + 1], 16) * 50.0 for l in range(2)]
        assert float(pairwise_ranking_loss(perfect, batch["topk"])) < 1e-6 < rank
        # the input is layer l+1's pre-attention stream: changing layer 0's stream leaves pair 0 as it was
        moved = {**batch, "pre": [batch["pre"][0] * 0.0, *batch["pre"][1:]]}
        assert torch.equal(pred(moved)[0], z[0])
    evaluate_recall(c, MODEL, "w", evaluation, {m: tmp_path / m for m in metas}, tmp_path / "recall" / "w.csv")
    recall = pd.read_csv(tmp_path / "recall" / "w.csv").set_index(["method", "M"])["expert_recall"]
    assert recall[("pre_attention", 4)] > max(0.5, recall[("specprefetch", 4)] + 0.01), recall  # chance: 0.25
    # without the stored inputs it says what to do
    with pytest.raises(PredictorError, match="traces.pre_attention: true"):
        pred({k: v for k, v in batch.items() if k != "pre"})
    with pytest.raises(PredictorError, match="no look-ahead"):
        build_predictor("pre_attention", c, PredictorDims(n_layers=3, hidden_size=32, n_experts=16, top_k=4,
                                                          lookahead=2))
