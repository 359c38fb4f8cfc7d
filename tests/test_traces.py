"""Trace storage (round trip, verification, atomicity, bounded memory) and extraction on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specprefetch.io import SpecPrefetchError
from specprefetch.traces.store import TraceError, TraceReader, TraceWriter, trace_stats

L, D, N, K = 2, 8, 6, 2


def _meta(**extra):
    return {"model": "m", "workload": "w", "arch": "test", "n_experts": N, "top_k": K, "hidden_size": D,
            "moe_layers": [1, 2], "scoring": "softmax", "provenance": {"seed": 0}, **extra}


def _routers(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"gate.{i}.weight": torch.randn(N, D, generator=g) for i in range(L)}


def _samples(n: int, seed: int = 0, lengths=None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n):
        t = lengths[s] if lengths else int(torch.randint(3, 12, (1,), generator=g))
        out.append({
            "x": [torch.randn(t, D, generator=g) for _ in range(L)],
            "logits": [torch.randn(t, N, generator=g) for _ in range(L)],
            "topk": [torch.randint(0, N, (t, K), generator=g) for _ in range(L)],
            "token_ids": torch.randint(0, 100, (t,), generator=g),
            "position": torch.arange(t),
            "is_image": torch.rand(t, generator=g) < 0.3,
            "is_prompt": torch.arange(t) < t // 2,
        })
    return out


def _write(out: Path, samples, shard_tokens=20, **kw) -> TraceWriter:
    with TraceWriter(out, {**_meta(), "routers": _routers()}, shard_tokens, **kw) as w:
        for s in samples:
            w.add_sample(**s)
    return w


@pytest.fixture
def trace(tmp_path):
    samples = _samples(9)
    out = tmp_path / "trace"
    _write(out, samples, shard_tokens=20, input_dtype="float32", logits_dtype="float32")
    return out, samples


def test_round_trip_exact_and_sharded(trace):
    out, samples = trace
    r = TraceReader(out)
    assert len(r.manifest["shards"]) >= 3
    assert r.n_layers == L and r.n_experts == N and r.top_k == K and r.hidden_size == D
    shards = list(r.iter_shards())
    cat = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
    ref_si = torch.cat([torch.full((len(s["token_ids"]),), j) for j, s in enumerate(samples)])
    assert torch.equal(cat["sample_index"], ref_si)
    for i in range(L):
        assert torch.equal(cat[f"x.{i}"], torch.cat([s["x"][i] for s in samples]))
        assert torch.equal(cat[f"logits.{i}"], torch.cat([s["logits"][i] for s in samples]))
        assert torch.equal(cat[f"topk.{i}"], torch.cat([s["topk"][i] for s in samples]).int())
    assert torch.equal(cat["token_ids"], torch.cat([s["token_ids"] for s in samples]))
    assert torch.equal(cat["is_image"], torch.cat([s["is_image"] for s in samples]).to(torch.uint8))
    # samples are never split across shards
    for s in shards:
        first, last = int(s["sample_index"][0]), int(s["sample_index"][-1])
        assert (cat["sample_index"] == first).sum() == (s["sample_index"] == first).sum()
        assert (cat["sample_index"] == last).sum() == (s["sample_index"] == last).sum()
    assert torch.equal(r.gate_weights()[1], _routers()["gate.1.weight"])


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_cover_every_token_once(trace, shuffle):
    out, samples = trace
    r = TraceReader(out)
    total = sum(len(s["token_ids"]) for s in samples)
    batches = list(r.iter_batches(7, shuffle=shuffle, seed=3))
    assert len(batches) == r.n_batches(7)
    assert all(len(b["token_ids"]) == 7 for b in batches[:-1])
    # identify each token by (sample, position)
    keys = torch.cat([b["sample_index"] * 1000 + b["position"] for b in batches])
    assert len(keys) == total and len(set(keys.tolist())) == total
    # rows stay aligned across tensors after shuffling: x.0 row matches the source sample/position
    b = batches[0]
    for j in range(len(b["token_ids"])):
        s, p = int(b["sample_index"][j]), int(b["position"][j])
        assert torch.equal(b["x"][1][j], samples[s]["x"][1][p])
        assert torch.equal(b["topk"][0][j], samples[s]["topk"][0][p].int())
    if shuffle:
        again = torch.cat([b["sample_index"] * 1000 + b["position"] for b in r.iter_batches(7, True, seed=3)])
        other = torch.cat([b["sample_index"] * 1000 + b["position"] for b in r.iter_batches(7, True, seed=4)])
        assert torch.equal(keys, again) and not torch.equal(keys, other)
        assert not torch.equal(keys, torch.sort(keys).values)
    else:
        assert torch.equal(keys, torch.sort(keys).values)


def test_flipped_byte_is_caught_and_named(trace):
    out, _ = trace
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    r = TraceReader(out)
    with pytest.raises(TraceError, match="shard-00001.safetensors"):
        list(r.iter_shards())
    with pytest.raises(TraceError, match="shard-00001.safetensors.*corrupt"):
        r.verify_all()
    with pytest.raises(TraceError, match="shard-00001"):
        list(r.iter_batches(5))


def test_truncated_shard_is_caught(trace):
    out, _ = trace
    shard = out / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(TraceError, match="shard-00002.safetensors.*truncated"):
        list(TraceReader(out, verify=False).iter_shards())
    with pytest.raises(TraceError, match="shard-00002"):
        TraceReader(out).verify_all()


def test_manifest_mismatch_and_missing_manifest(trace, tmp_path):
    out, _ = trace
    m = json.loads((out / "manifest.json").read_text())
    m["hidden_size"] = D + 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match="shard-00000.safetensors: x.0"):
        next(TraceReader(out).iter_shards())
    (out / "manifest.json").unlink()
    with pytest.raises(TraceError, match="not a complete trace"):
        TraceReader(out)


def test_exception_inside_writer_leaves_nothing(tmp_path):
    out = tmp_path / "trace"
    with pytest.raises(KeyboardInterrupt):
        with TraceWriter(out, {**_meta(), "routers": _routers()}, 10) as w:
            for s in _samples(6):
                w.add_sample(**s)
            raise KeyboardInterrupt
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_missing_routers_fails_without_output(tmp_path):
    out = tmp_path / "trace"
    with pytest.raises(SpecPrefetchError, match="router"):
        with TraceWriter(out, _meta(), 10) as w:
            w.add_sample(**_samples(1)[0])
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_sample_shape_is_named(tmp_path):
    s = _samples(1)[0]
    s["logits"][1] = s["logits"][1][:, :-1]
    with pytest.raises(SpecPrefetchError, match="logits.1 has shape"):
        _write(tmp_path / "t", [s])
    assert not (tmp_path / "t").exists()


def test_manifest_fields_and_dtypes(tmp_path):
    out = tmp_path / "t"
    samples = _samples(5)
    _write(out, samples, shard_tokens=16, input_dtype="bfloat16", logits_dtype="float16")
    m = json.loads((out / "manifest.json").read_text())
    for key in ("format", "model", "workload", "arch", "n_experts", "top_k", "hidden_size", "n_moe_layers",
                "moe_layers", "scoring", "n_tokens", "n_samples", "dtypes", "shards", "provenance"):
        assert key in m, key
    assert m["format"] == "specprefetch-trace/1" and m["n_moe_layers"] == L and m["n_samples"] == 5
    assert m["n_tokens"] == sum(len(s["token_ids"]) for s in samples)
    assert set(m["shards"][0]) >= {"file", "n_tokens", "n_samples", "bytes", "sha256"}
    assert m["dtypes"]["x"] == "bfloat16" and m["dtypes"]["logits"] == "float16"
    shard = next(TraceReader(out).iter_shards())
    assert shard["x.0"].dtype == torch.bfloat16 and shard["logits.0"].dtype == torch.float16
    assert shard["topk.0"].dtype == torch.int32 and shard["position"].dtype == torch.int32
    assert shard["is_image"].dtype == torch.uint8 and shard["token_ids"].dtype == torch.int64
    assert torch.equal(shard["x.0"][:3], samples[0]["x"][0][:3].bfloat16())
    with pytest.raises(SpecPrefetchError, match="traces.input_dtype"):
        TraceWriter(out, _meta(), 8, input_dtype="int8")
    st = trace_stats(out)
    assert st["n_tokens"] == m["n_tokens"]
    assert st["bytes_per_token_per_layer"] == D * 2 + N * 2 + K * 4
    assert 0 < st["image_token_share"] < 1 and st["bytes_per_token"] > L * st["bytes_per_token_per_layer"]
    n_img = sum(int(s["is_image"].sum()) for s in samples)
    assert st["image_token_share"] == n_img / m["n_tokens"] and m["n_image_tokens"] == n_img


def test_writer_memory_is_bounded_by_one_shard(tmp_path):
    lengths = [5, 7, 3, 9, 4, 6, 8, 2, 7, 5, 6, 9, 3, 4, 8] * 4
    shard_tokens = 16
    w = _write(tmp_path / "t", _samples(len(lengths), lengths=lengths), shard_tokens=shard_tokens)
    assert w.max_buffered_tokens <= shard_tokens and w.buffered_tokens == 0
    m = TraceReader(tmp_path / "t").manifest
    assert all(s["n_tokens"] <= shard_tokens for s in m["shards"])
    assert len(m["shards"]) >= sum(lengths) // shard_tokens
    # a sample longer than a shard gets a shard of its own, never split
    w = _write(tmp_path / "u", _samples(3, lengths=[4, 40, 4]), shard_tokens=16)
    assert [s["n_tokens"] for s in TraceReader(tmp_path / "u").manifest["shards"]] == [4, 40, 4]
    assert w.max_buffered_tokens == 40


def test_same_input_same_shard_bytes(tmp_path):
    samples = _samples(6)
    _write(tmp_path / "a", samples)
    _write(tmp_path / "b", samples)
    ma = json.loads((tmp_path / "a" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]


def test_cli_verify_traces_names_corrupt_shard(trace, capsys):
    from specprefetch.cli import main

    out, _ = trace
    assert main(["verify-traces", str(out)]) == 0
    shard = out / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify-traces", str(out)]) != 0
    assert "shard-00000.safetensors" in capsys.readouterr().err
    assert main(["trace-stats", str(out)]) == 0


# ------------------------------------------------------------------------------------------ extraction
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<image>"]
SAMPLES = [
    ("s-0", "What is 2 plus 3?", "The answer is 5.", False),
    ("s-1", "Read the text in the image.", "HELLO 42", True),
    ("s-2", "Write a function that adds two numbers.", "def add(a, b):\n    return a + b", False),
]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([p + " " + r for _, p, r, _ in SAMPLES] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", extra_special_tokens=SPECIAL[2:])


@pytest.fixture(scope="module")
def smoke_cfg():
    from specprefetch.config import REPO_ROOT, load_config

    return load_config(REPO_ROOT / "config" / "smoke.yaml")


@pytest.fixture(scope="module")
def workload_dir(tmp_path_factory, smoke_cfg):
    import io

    from PIL import Image

    from specprefetch.data.workloads import Sample, write_workload

    root = tmp_path_factory.mktemp("wl") / "tiny"
    size = smoke_cfg["image"]["size"]
    g = torch.Generator().manual_seed(0)
    images, samples = {}, []
    for sid, prompt, ref, has_image in SAMPLES:
        rel = f"images/{sid}.png" if has_image else None
        if rel:
            buf = io.BytesIO()
            arr = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(arr, "RGB").save(buf, format="PNG")
            images[rel] = buf.getvalue()
        samples.append(Sample(id=sid, benchmark="tiny", prompt=prompt, reference=ref, image=rel, split="test",
                              source="hand-written"))
    return write_workload(root, samples, images, generator="test", seed=0, provenance={})


@pytest.fixture(scope="module", params=["tiny-qwen3-vl-moe", "tiny-deepseek-vl2"])
def model_dir(request, tmp_path_factory, smoke_cfg):
    from specprefetch.models.standins import build_stand_in, save_stand_in

    torch.manual_seed(0)
    stand_in = build_stand_in(smoke_cfg, request.param, _tokenizer())
    out = tmp_path_factory.mktemp("models") / request.param
    save_stand_in(stand_in, out)
    return request.param, out


def _executed(bundle, enc):
    """What the model itself did: each gate's input and its returned expert indices (forward hooks)."""
    spec = bundle.routing
    inputs, indices, handles = [], [], []
    for gate in spec.gates:
        handles.append(gate.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, spec.hidden_size))))
        handles.append(gate.register_forward_hook(lambda m, a, out: indices.append(out[2])))
    try:
        with torch.inference_mode():
            bundle.model(**enc.kwargs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return inputs, indices


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_extraction_matches_executed_experts(smoke_cfg, model_dir, workload_dir, tmp_path, input_dtype):
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import encode_sample, load_bundle
    from specprefetch.traces.extract import extract_traces

    name, mdir = model_dir
    cfg = {**smoke_cfg, "traces": {**smoke_cfg["traces"], "shard_tokens": 64, "input_dtype": input_dtype}}
    out = tmp_path / "trace"
    stats = extract_traces(cfg, name, mdir, workload_dir, out)
    r = TraceReader(out)
    r.verify_all()
    bundle = load_bundle(cfg, name, mdir)
    spec = bundle.routing
    m = r.manifest
    assert m["model"] == name and m["workload"] == "tiny" and m["n_samples"] == len(SAMPLES)
    assert m["n_moe_layers"] == len(spec.moe_layers) and m["moe_layers"] == spec.moe_layers
    assert m["provenance"]["workload_manifest_sha256"] and m["provenance"]["model"]["model_dir_sha256"]
    assert len(m["shards"]) >= 2 and stats["n_tokens"] == m["n_tokens"]
    for i, w in enumerate(r.gate_weights()):
        assert torch.equal(w, spec.gates[i].weight.float())
    shards = list(r.iter_shards())
    cat = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
    dtype = getattr(torch, input_dtype)
    n_image = 0
    for j, sample in enumerate(read_workload(workload_dir)):
        enc = encode_sample(bundle, sample, workload_dir)
        rows = cat["sample_index"] == j
        assert int(rows.sum()) == int(enc.valid.sum())
        assert torch.equal(cat["token_ids"][rows], enc.input_ids[enc.valid])
        assert torch.equal(cat["is_prompt"][rows].bool(), enc.is_prompt[enc.valid])
        assert torch.equal(cat["is_image"][rows].bool(), enc.is_image[enc.valid])
        n_image += int(enc.is_image.sum())
        inputs, indices = _executed(bundle, enc)
        for i in range(r.n_layers):
            assert torch.equal(cat[f"x.{i}"][rows], inputs[i].to(dtype))
            stored = cat[f"topk.{i}"][rows].long().sort(dim=-1).values
            assert torch.equal(stored, indices[i].sort(dim=-1).values), f"layer {i} sample {j}"
            with torch.inference_mode():
                assert torch.equal(cat[f"logits.{i}"][rows], spec.logits(i, inputs[i]))
    assert n_image > 0 and int(cat["is_image"].sum()) == n_image


def test_extraction_generate_mode(smoke_cfg, model_dir, workload_dir, tmp_path):
    from specprefetch.traces.extract import extract_traces

    name, mdir = model_dir
    cfg = {**smoke_cfg, "traces": {**smoke_cfg["traces"], "mode": "generate", "max_new_tokens": 4}}
    extract_traces(cfg, name, mdir, workload_dir, tmp_path / "gen")
    r = TraceReader(tmp_path / "gen")
    assert r.manifest["mode"] == "generate"
    shard = next(r.iter_shards())
    rows = shard["sample_index"] == 0
    n_cont = int((shard["is_prompt"][rows] == 0).sum())
    assert 1 <= n_cont <= 4  # the continuation, not the reference
    assert torch.equal(shard["position"][rows], torch.arange(int(rows.sum()), dtype=torch.int32))


def test_extraction_failure_leaves_no_output(smoke_cfg, model_dir, workload_dir, tmp_path):
    from specprefetch.traces.extract import extract_traces

    name, mdir = model_dir
    bad = {**smoke_cfg, "traces": {**smoke_cfg["traces"], "mode": "nonsense"}}
    with pytest.raises(SpecPrefetchError, match="traces.mode"):
        extract_traces(bad, name, mdir, workload_dir, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_cli_extract_traces(model_dir, workload_dir, tmp_path, capsys):
    from specprefetch.cli import main
    from specprefetch.config import REPO_ROOT

    name, mdir = model_dir
    out = tmp_path / "cli"
    argv = ["extract-traces", "--config", str(REPO_ROOT / "config" / "smoke.yaml"), "--model", name,
            "--model-dir", str(mdir), "--workload-dir", str(workload_dir), "--out", str(out)]
    assert main(argv) == 0
    assert TraceReader(out).manifest["n_samples"] == len(SAMPLES)
    assert main(["trace-stats", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["n_tokens"] > 0
    assert main([*argv[:-1], str(tmp_path / "none"), "--model", "no-such-model"]) != 0
    assert not (tmp_path / "none").exists()


def test_gate_output_indices_formats():
    from specprefetch.traces.extract import gate_output_indices

    idx = torch.randint(0, N, (5, K))
    logits, weights = torch.randn(5, N), torch.rand(5, K)
    assert torch.equal(gate_output_indices((logits, weights, idx), K), idx)  # transformers routers
    assert torch.equal(gate_output_indices((idx.view(1, 5, K), weights, None), K), idx)  # DeepSeek-VL2 MoEGate
    assert gate_output_indices(logits, K) is None  # logits only: recompute
    assert gate_output_indices((idx, idx.clone()), K) is None  # ambiguous: recompute


def test_gate_indices_and_recompute_agree(smoke_cfg, model_dir, workload_dir):
    """The fast path (the gates' own indices, reordered best first) equals the RoutingSpec recompute."""
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import encode_sample, load_bundle
    from specprefetch.models.capture import RouterCapture
    from specprefetch.traces.extract import GateOutputs, route_captured

    name, mdir = model_dir
    bundle = load_bundle(smoke_cfg, name, mdir)
    spec = bundle.routing
    enc = encode_sample(bundle, read_workload(workload_dir)[1], workload_dir)
    with torch.inference_mode():
        with RouterCapture(bundle.model, spec) as cap, GateOutputs(spec) as gates:
            bundle.model(**enc.kwargs, use_cache=False)
        xs, executed = cap.inputs(), gates.indices()
        assert all(e is not None for e in executed)
        fast = route_captured(spec, xs, enc.valid, torch.float32, torch.float32, executed=executed, check=True)
        slow = route_captured(spec, xs, enc.valid, torch.float32, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(fast[2], slow[2]))
        wrong = [e.roll(1, dims=-1) + 0 for e in executed]
        wrong[0] = (wrong[0] + 1) % spec.n_experts
        with pytest.raises(SpecPrefetchError, match="gate 0"):
            route_captured(spec, xs, None, torch.float32, torch.float32, executed=wrong, check=True)


def _concat(reader: TraceReader) -> dict[str, torch.Tensor]:
    shards = list(reader.iter_shards())
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def test_scatter_shards_gather_into_the_single_job_trace(smoke_cfg, model_dir, workload_dir, tmp_path):
    """Extraction split over 3 jobs (--shard I/3) and gathered reads exactly like one job's trace."""
    from specprefetch.cli import main
    from specprefetch.config import REPO_ROOT
    from specprefetch.traces.extract import extract_traces
    from specprefetch.traces.store import gather_traces

    name, mdir = model_dir
    cfg = {**smoke_cfg, "traces": {**smoke_cfg["traces"], "shard_tokens": 60}}  # 2 files for 3 samples
    whole = tmp_path / "whole"
    extract_traces(cfg, name, mdir, workload_dir, whole)
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i, part in enumerate(parts):
        extract_traces(cfg, name, mdir, workload_dir, part, shard=(i, 3))
    with pytest.raises(SystemExit):
        main(["extract-traces", "--config", str(REPO_ROOT / "config" / "smoke.yaml"), "--model", name,
              "--workload-dir", str(workload_dir), "--out", str(tmp_path / "x"), "--shard", "3/3"])
    ranges = [TraceReader(p).manifest["scatter"]["samples"] for p in parts]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(SAMPLES) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(TraceError, match=r"not shards 0..N-1"):
        gather_traces(parts[:2], tmp_path / "incomplete")  # a shard missing
    assert not (tmp_path / "incomplete").exists()
    out = tmp_path / "gathered"
    assert main(["gather-traces", *map(str, reversed(parts)), "--out", str(out)]) == 0  # any order
    a, b = TraceReader(whole), TraceReader(out)
    assert b.verify_all()["ok"]
    for k in ("n_tokens", "n_samples", "n_image_tokens", "n_prompt_tokens", "moe_layers", "model", "workload"):
        assert a.manifest[k] == b.manifest[k], k
    assert len(a.manifest["shards"]) == 2 < len(parts)  # the gathered trace is repacked, not concatenated
    ta, tb = _concat(a), _concat(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k  # same tokens, same order, same (workload-global) sample_index
    # file for file what one job writes (same shard boundaries, so the same shuffled training order)
    assert [(e["n_tokens"], e["sha256"]) for e in a.manifest["shards"]] == \
        [(e["n_tokens"], e["sha256"]) for e in b.manifest["shards"]]
    assert len(b.manifest["provenance"]["gathered_from"]) == 3
    single = tmp_path / "single"
    assert main(["gather-traces", str(whole), "--out", str(single)]) == 0  # one shard: hard-linked as it is
    assert (single / "shard-00000.safetensors").stat().st_nlink == 2


def test_gather_rejects_shards_of_different_traces(smoke_cfg, model_dir, workload_dir, tmp_path):
    from specprefetch.traces.extract import extract_traces
    from specprefetch.traces.store import gather_traces

    name, mdir = model_dir
    p0, p1 = tmp_path / "p0", tmp_path / "p1"
    extract_traces(smoke_cfg, name, mdir, workload_dir, p0, shard=(0, 2))
    other = {**smoke_cfg, "traces": {**smoke_cfg["traces"], "logits_dtype": "float16"}}
    extract_traces(other, name, mdir, workload_dir, p1, shard=(1, 2))
    with pytest.raises(TraceError, match=r"p1/manifest.json: dtypes=.*differs from"):
        gather_traces([p0, p1], tmp_path / "g")
    assert not (tmp_path / "g").exists()
    n = 2 * len(SAMPLES)
    with pytest.raises(SpecPrefetchError, match=f"scatter shard 0 of {n} is empty"):
        extract_traces(smoke_cfg, name, mdir, workload_dir, tmp_path / "e", shard=(0, n))


def test_sizing_matches_a_real_trace_and_plans_the_paper_profile(smoke_cfg, model_dir, workload_dir, tmp_path):
    """estimate-resources: bytes/token from the config equal a written trace's; tokens are measured from results/."""
    from specprefetch.config import REPO_ROOT, load_config
    from specprefetch.traces.extract import extract_traces
    from specprefetch.traces.sizing import TOKEN_META_BYTES, bytes_per_token, estimate, trace_sets

    name, mdir = model_dir
    out = tmp_path / "results" / "traces" / name / "gsm8k"
    stats = extract_traces(smoke_cfg, name, mdir, workload_dir, out)
    assert bytes_per_token(smoke_cfg, name) == stats["bytes_per_token_per_layer"] * stats["n_moe_layers"] + \
        TOKEN_META_BYTES
    measured = {(s.model, s.workload): s for s in trace_sets(smoke_cfg, tmp_path / "results")}
    assert measured[(name, "gsm8k")].measured and measured[(name, "gsm8k")].tokens == stats["n_tokens"]
    assert not measured[(name, "corpus")].measured
    paper = load_config(REPO_ROOT / "config" / "paper.yaml")
    rows = {r["rule"]: r for r in estimate(paper)}
    assert rows["extract_traces"]["jobs"] == 10 * paper["traces"]["scatter"]  # online training: no corpus traces
    assert rows["extract_traces"]["storage_gb"] > 100 and rows["train_predictor"]["gpu_hours"] > 1
    # one train_predictor job per (model, method, seed), a training-free method once: what the DAG plans
    from specprefetch.config import LEARNED_METHODS
    seeded = {**smoke_cfg, "predictors": {**smoke_cfg["predictors"], "seeds": 3}}
    methods = seeded["predictors"]["methods"]
    n_learned = sum(m in LEARNED_METHODS for m in methods)
    one, three = ({r["rule"]: r for r in estimate(c)}["train_predictor"]
                  for c in ({**seeded, "predictors": {**seeded["predictors"], "seeds": 1}}, seeded))
    assert three["jobs"] == len(seeded["models"]) * (len(methods) + 2 * n_learned)
    assert n_learned and three["tokens"] == 3 * one["tokens"] and "3 seed(s)" in three["note"]
