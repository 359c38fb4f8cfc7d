"""Stand-in realism (traces.realism, the measure-realism CLI, table0_realism) on tiny hand-built traces."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from specprefetch.io import SpecPrefetchError
from specprefetch.traces.realism import measure_realism, normalised_entropy, read_realism, write_realism
from specprefetch.traces.store import TraceWriter

N, K, D, L = 8, 2, 6, 3


def _meta(model: str = "m", workload: str = "w", scoring: str = "softmax") -> dict:
    return {"model": model, "workload": workload, "arch": "test", "n_experts": N, "top_k": K, "hidden_size": D,
            "moe_layers": list(range(L)), "scoring": scoring, "provenance": {}}


def _routers(seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"gate.{i}.weight": torch.randn(N, D, generator=g) for i in range(L)}
    if bias:
        out.update({f"gate.{i}.e_score_correction_bias": torch.randn(N, generator=g) * 0.1 for i in range(L)})
    return out


def _samples(n: int, seed: int = 1, image_share: float = 0.4) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(3, 9, (1,), generator=g))
        out.append({"x": [torch.randn(t, D, generator=g) for _ in range(L)],
                    "logits": [torch.randn(t, N, generator=g) for _ in range(L)],
                    "topk": [torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(t)]) for _ in range(L)],
                    "token_ids": torch.randint(0, 50, (t,), generator=g), "position": torch.arange(t),
                    "is_image": torch.rand(t, generator=g) < image_share, "is_prompt": torch.ones(t, dtype=torch.bool)})
    return out


def _write(out: Path, samples: list[dict], meta: dict | None = None, routers: dict | None = None,
           sample_offset: int = 0) -> Path:
    with TraceWriter(out, {**(meta or _meta()), "routers": routers or _routers()}, 16, input_dtype="float32",
                     sample_offset=sample_offset) as w:
        for s in samples:
            w.add_sample(**s)
    return out


def _reference(samples: list[dict], routers: dict, scoring: str = "softmax") -> dict[str, dict[str, float]]:
    """Token by token, the definitions in the module docstring (no shared code with the module)."""
    acc = {k: {"n": 0, "hits": 0.0, "cos": 0.0, "load": torch.zeros(L, N)} for k in ("text", "image")}
    for s in samples:
        for t in range(s["token_ids"].shape[0]):
            a = acc["image" if bool(s["is_image"][t]) else "text"]
            a["n"] += 1
            for l in range(L - 1):
                z = routers[f"gate.{l + 1}.weight"] @ s["x"][l][t]
                if scoring == "sigmoid":
                    score = torch.sigmoid(z) + routers[f"gate.{l + 1}.e_score_correction_bias"]
                else:
                    score = torch.softmax(z, -1)
                cand = set(torch.argsort(score, descending=True)[:K].tolist())
                a["hits"] += len(cand & set(s["topk"][l + 1][t].tolist())) / K / (L - 1)
                a["cos"] += float(F.cosine_similarity(s["x"][l][t], s["x"][l + 1][t], dim=0)) / (L - 1)
            for l in range(L):
                for e in s["topk"][l][t].tolist():
                    a["load"][l, e] += 1
    out = {}
    for kind, parts in (("all", ("text", "image")), ("text", ("text",)), ("image", ("image",))):
        n = sum(acc[p]["n"] for p in parts)
        load = sum(acc[p]["load"] for p in parts)
        ent = []
        for l in range(L):
            p = load[l] / load[l].sum()
            ent.append(-sum(float(v) * math.log(float(v)) for v in p if v > 0) / math.log(N))
        out[kind] = {"n_tokens": n, "fate_recall": sum(acc[p]["hits"] for p in parts) / n,
                     "input_cosine": sum(acc[p]["cos"] for p in parts) / n, "load_entropy": sum(ent) / L}
    return out


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_measures_match_the_definitions_by_token_type(tmp_path: Path, scoring: str) -> None:
    samples, routers = _samples(7), _routers(bias=scoring == "sigmoid")
    trace = _write(tmp_path / "t", samples, _meta(scoring=scoring), routers)
    rows = {r["tokens"]: r for r in measure_realism([trace])}
    ref = _reference(samples, routers, scoring)
    assert set(rows) == {"all", "text", "image"}
    for kind, want in ref.items():
        assert rows[kind]["n_tokens"] == want["n_tokens"] and rows[kind]["M"] == K
        for key in ("fate_recall", "input_cosine", "load_entropy"):
            assert rows[kind][key] == pytest.approx(want[key], abs=1e-6), (kind, key)


def test_fate_recall_equals_the_fate_predictor(tmp_path: Path) -> None:
    """The `all` row is Table 1's FATE cell at M = K: the same scores, the same top-M and recall."""
    from specprefetch.metrics import recall_per_token, select_candidates
    from specprefetch.predictors.base import PredictorDims
    from specprefetch.predictors.fate import FatePredictor

    samples, routers = _samples(9, seed=3), _routers(seed=3)
    trace = _write(tmp_path / "t", samples, routers=routers)
    pred = FatePredictor(PredictorDims(n_layers=L, n_experts=N, top_k=K, hidden_size=D, scoring="softmax"))
    pred.set_gates(routers)
    hits, n = 0.0, 0
    for s in samples:
        scores = pred.token_scores({"x": s["x"]})
        n += s["token_ids"].shape[0]
        hits += sum(float(recall_per_token(s["topk"][l + 1], select_candidates(sc, K)).sum())
                    for l, sc in enumerate(scores)) / (L - 1)
    row = next(r for r in measure_realism([trace]) if r["tokens"] == "all")
    assert row["fate_recall"] == pytest.approx(hits / n, abs=1e-9)


def test_perfect_and_collapsed_routing(tmp_path: Path) -> None:
    """Identical adjacent inputs routed by the next gate: recall 1, cosine 1; one expert pair for every token:
    entropy log(2)/log(N)."""
    routers = _routers(seed=5)
    samples = _samples(4, seed=5, image_share=0.0)
    for s in samples:
        x0 = s["x"][0]
        s["x"] = [x0.clone() for _ in range(L)]
        s["topk"] = [s["topk"][0]] + [torch.topk(x0 @ routers[f"gate.{l}.weight"].T, K).indices for l in range(1, L)]
    row = measure_realism([_write(tmp_path / "a", samples, routers=routers)])
    assert [r["tokens"] for r in row] == ["all", "text"]  # no image tokens: no image row
    assert row[0]["fate_recall"] == pytest.approx(1.0) and row[0]["input_cosine"] == pytest.approx(1.0)
    load = torch.zeros(2, N)
    load[:, :2] = 10
    assert normalised_entropy(load) == pytest.approx(math.log(2) / math.log(N))
    assert normalised_entropy(torch.ones(1, N)) == pytest.approx(1.0)


def test_scatter_shards_measure_like_the_whole_set(tmp_path: Path) -> None:
    samples = _samples(8, seed=7)
    whole = measure_realism([_write(tmp_path / "whole", samples)])
    parts = measure_realism([_write(tmp_path / "s0", samples[:3]), _write(tmp_path / "s1", samples[3:],
                                                                           sample_offset=3)])
    assert len(whole) == len(parts) == 3
    for a, b in zip(whole, parts, strict=True):
        assert a["n_tokens"] == b["n_tokens"]
        for key in ("fate_recall", "input_cosine", "load_entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-9)


def test_bad_inputs_are_one_line(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", _samples(2))
    other = _write(tmp_path / "b", _samples(2), routers=_routers(seed=9))
    with pytest.raises(SpecPrefetchError, match="router weights differ"):
        measure_realism([a, other])
    with pytest.raises(SpecPrefetchError, match="not one of the config's models"):
        measure_realism([a], models=["tiny-qwen3-vl-moe"])
    with pytest.raises(SpecPrefetchError, match="no trace directories"):
        measure_realism([])
    with pytest.raises(SpecPrefetchError, match="manifest.json: missing"):
        measure_realism([tmp_path / "nowhere"])
    bad = tmp_path / "bad.csv"
    rows = measure_realism([a])
    rows[0]["load_entropy"] = 1.5
    with pytest.raises(SpecPrefetchError, match="'load_entropy', line 2.*out of range"):
        write_realism(rows, bad)
    assert not bad.exists()


def _realism_csv(cfg: dict, path: Path, fate: float = 0.8) -> Path:
    rows = []
    for m, mc in cfg["models"].items():
        for w, wc in cfg["workloads"].items():
            kinds = ("all", "text", "image") if wc["category"] == "VLM" else ("all", "text")
            rows += [{"model": m, "workload": w, "tokens": t, "M": mc["top_k"], "n_tokens": 100,
                      "fate_recall": fate, "input_cosine": 0.9, "load_entropy": 0.95} for t in kinds]
    write_realism(rows, path)
    return path


def test_table0_compares_with_the_papers_fate(cfg: dict, tmp_path: Path) -> None:
    from specprefetch.render.reported import load_reported
    from specprefetch.render.tables import render_table

    csv = _realism_csv(cfg, tmp_path / "realism.csv", fate=0.8)
    doc = render_table("table0_realism", cfg, {"realism": csv}, tmp_path / "table0_realism.tex")
    paper = {(c.keys["model"], c.keys["workload"]): c.value for c in load_reported().tables["table1_recall"].cells
             if c.keys["method"] == "FATE" and c.keys["budget"] == "K"}
    cells = doc.by_id()
    n_within = 0
    for (model, workload), ref in paper.items():
        delta = cells[f"{model}/{workload}/delta"]
        assert cells[f"{model}/{workload}/paper"].value == ref and delta.value == pytest.approx(80.0 - ref)
        n_within += abs(80.0 - ref) <= 5.0
    assert doc.meta["within_target"] == n_within and doc.meta["compared"] == len(paper) == 10
    tex = (tmp_path / "table0_realism.tex").read_text()
    assert f"({n_within} of 10 cells)" in tex and r"\textbf{-1.40}" in tex  # GSM8K Qwen: 80 - 81.40
    assert cells["Qwen3-VL-30B-A3B/GSM8K/recall_image"].value is None  # a text-only workload: a dash


def test_table0_rejects_a_missing_or_stale_row(cfg: dict, tmp_path: Path) -> None:
    from specprefetch.render.data import RenderInputError
    from specprefetch.render.tables import render_table

    csv = _realism_csv(cfg, tmp_path / "realism.csv")
    df = read_realism(csv)
    df[~((df["workload"] == "gsm8k") & (df["tokens"] == "all"))].to_csv(tmp_path / "r1.csv", index=False)
    with pytest.raises(RenderInputError, match="workload='gsm8k', tokens='all'"):
        render_table("table0_realism", cfg, {"realism": tmp_path / "r1.csv"}, tmp_path / "t.tex")
    df.assign(M=df["M"] + 1).to_csv(tmp_path / "r2.csv", index=False)
    with pytest.raises(RenderInputError, match="column 'M'"):
        render_table("table0_realism", cfg, {"realism": tmp_path / "r2.csv"}, tmp_path / "t.tex")
    pd.concat([df, df.head(1)]).to_csv(tmp_path / "r3.csv", index=False)
    with pytest.raises(RenderInputError, match="duplicate rows"):
        render_table("table0_realism", cfg, {"realism": tmp_path / "r3.csv"}, tmp_path / "t.tex")


def test_cli_measure_realism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specprefetch.cli import main
    from specprefetch.config import REPO_ROOT, load_config

    cfg = load_config(REPO_ROOT / "config" / "smoke.yaml")
    model = next(iter(cfg["models"]))
    trace = _write(tmp_path / "t", _samples(3), _meta(model=model, workload="gsm8k"))
    out = tmp_path / "realism.csv"
    main(["measure-realism", "--config", str(REPO_ROOT / "config" / "smoke.yaml"), "--out", str(out), str(trace)])
    df = read_realism(out)
    assert list(df["tokens"]) == ["all", "text", "image"] and set(df["model"]) == {model}
    assert "fate_recall" in capsys.readouterr().out


def test_rule_reads_every_evaluation_trace_shard() -> None:
    from specprefetch.config import REPO_ROOT, load_config
    from specprefetch.render.targets import COMPARED_TABLES, RESULT_PATHS, TABLE_NAMES
    from specprefetch.workflow import Pipeline

    cfg = load_config(REPO_ROOT / "config" / "smoke.yaml")
    p = Pipeline(cfg, REPO_ROOT)
    ins = p.realism_inputs()
    assert len(ins) == len(cfg["models"]) * len(cfg["workloads"]) * p.scatter
    assert all("corpus" not in d for d in ins) and p.resources("measure_realism")["mem_mb"] > 0
    assert p.result_path("realism") == RESULT_PATHS["realism"]
    assert "table0_realism" in TABLE_NAMES and "table0_realism" not in COMPARED_TABLES
    smk = (REPO_ROOT / "workflow" / "rules" / "realism.smk").read_text()
    assert "rule measure_realism:" in smk and 'include: "workflow/rules/realism.smk"' in (
        REPO_ROOT / "Snakefile").read_text()
