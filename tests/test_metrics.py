"""ExpertRecall: hand-made cases, candidate selection (token vs batch level), evaluate/gather outputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch

from specprefetch.cli import main as cli_main
from specprefetch.config import budgets_for, load_config
from specprefetch.io import SpecPrefetchError
from specprefetch.metrics import aggregate_by_sample, expert_recall, recall_per_token, select_candidates
from specprefetch.predictors import PredictorDims, build_predictor
from specprefetch.predictors.evaluate import (
    candidate_sets,
    evaluate_recall,
    gather_params,
    gather_recall,
    per_layer_path,
)
from specprefetch.predictors.train import train_predictor
from specprefetch.stages.common import parse_predictor_args
from tests.test_predictors import MODEL, make_trace

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------- the metric


def test_recall_hand_made_cases() -> None:
    topk = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert expert_recall(topk, topk) == 1.0  # perfect
    assert expert_recall(topk, topk.flip(-1)) == 1.0  # order does not matter
    assert expert_recall(topk, torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]])) == 0.0  # disjoint
    # partial: token 0 gets 2/4, token 1 gets 1/4 -> mean 3/8
    assert expert_recall(topk, torch.tensor([[0, 2, 9, 10], [7, 11, 12, 13]])) == pytest.approx(3 / 8)
    # M < K: bounded by M/K even for perfect candidates
    assert expert_recall(topk, topk[:, :2]) == 0.5
    assert expert_recall(topk, torch.tensor([[3], [9]])) == pytest.approx(1 / 8)
    # -1 slots (a method with fewer candidates) never match; duplicates do not count twice
    assert expert_recall(topk, torch.tensor([[-1, -1, 0, 0], [4, 4, 4, -1]])) == pytest.approx(1 / 4)
    # one candidate set for every token (batch-level)
    assert expert_recall(topk, torch.tensor([0, 1, 4, 9])) == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert recall_per_token(topk, torch.tensor([0, 1, 4, 9])).tolist() == [0.5, 0.25]


def test_recall_bad_shapes() -> None:
    with pytest.raises(SpecPrefetchError, match="does not match"):
        expert_recall(torch.zeros(3, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(SpecPrefetchError, match="no tokens"):
        expert_recall(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long))


def test_select_candidates_is_stable_and_nested() -> None:
    s = torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.0]])
    assert select_candidates(s, 3).tolist() == [[1, 2, 3]]  # tie -> lower id first
    big = select_candidates(s, 5)
    for m in range(1, 6):
        assert torch.equal(select_candidates(s, m), big[:, :m])  # C_M is a prefix of C_M'
    assert select_candidates(s, 5, empty_when_zero=True).tolist() == [[1, 2, 3, 0, -1]]
    with pytest.raises(SpecPrefetchError, match="M=6"):
        select_candidates(s, 6)


def _one_layer_batch(probs_next: torch.Tensor, topk_next: torch.Tensor, sample_index: list[int]) -> dict:
    """A 2-layer batch whose layer-1 'truth' is given; the oracle/priority logic reads layer 1 only."""
    t, n = probs_next.shape
    logits = probs_next.clamp_min(1e-9).log()
    return {"x": [torch.zeros(t, 4)] * 2, "logits": [torch.zeros(t, n), logits],
            "topk": [torch.zeros_like(topk_next), topk_next], "token_ids": torch.zeros(t, dtype=torch.long),
            "sample_index": torch.tensor(sample_index), "position": torch.tensor(
                [i - sample_index.index(s) for i, s in enumerate(sample_index)])}


def test_batch_vs_token_level_candidates() -> None:
    """Token level: each token's own TopM; batch level: TopM of s = Σ_t π̂_t over the token's sample."""
    dims = PredictorDims(n_layers=2, hidden_size=4, n_experts=4, top_k=1)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1],   # sample 0
                          [0.0, 0.6, 0.4, 0.0],
                          [0.0, 0.6, 0.4, 0.0],
                          [0.1, 0.1, 0.1, 0.7]])  # sample 1
    topk = probs.argmax(-1, keepdim=True)
    b = _one_layer_batch(probs, topk, [0, 0, 0, 1])
    oracle = build_predictor("oracle", None, dims)
    tok = candidate_sets(oracle, b, 1, "token")[0]
    assert tok.flatten().tolist() == [0, 1, 1, 3]
    bat = candidate_sets(oracle, b, 1, "batch")[0]
    assert bat.flatten().tolist() == [1, 1, 1, 3]  # expert 1 serves 2 of sample 0's 3 tokens
    assert expert_recall(topk, tok) == 1.0
    assert expert_recall(topk, bat) == 0.75
    agg, groups = aggregate_by_sample(probs, b["sample_index"])
    assert groups.tolist() == [0, 0, 0, 1]
    torch.testing.assert_close(agg[0], probs[:3].double().sum(0))
    # the learned path: batch priorities are sums of π̂ (here FATE with an identity-like gate)
    fate = build_predictor("fate", None, PredictorDims(n_layers=2, hidden_size=4, n_experts=4, top_k=1))
    fate.set_gates({"gate.0.weight": torch.eye(4), "gate.1.weight": torch.eye(4)})
    b["x"] = [probs.log().clamp_min(-30), probs]
    s = fate.priorities(b, "token")[0]
    expect = torch.stack([s[:3].sum(0).argsort(descending=True, stable=True)[:2]] * 3
                         + [s[3:].sum(0).argsort(descending=True, stable=True)[:2]])
    assert torch.equal(candidate_sets(fate, b, 2, "batch")[0], expect)


def test_oracle_and_previous_token_bounds() -> None:
    g = torch.Generator().manual_seed(0)
    t, n, k = 30, 16, 4
    logits = torch.randn(t, n, generator=g)
    topk = logits.topk(k).indices
    b = _one_layer_batch(logits.softmax(-1), topk, [0] * 10 + [1] * 20)
    dims = PredictorDims(n_layers=2, hidden_size=4, n_experts=n, top_k=k)
    oracle = build_predictor("oracle", None, dims)
    c = candidate_sets(oracle, b, 6, "token")[0]
    assert expert_recall(topk, c[:, :k]) == 1.0
    assert expert_recall(topk, c[:, :2]) == 0.5
    # oracle candidates at M < K are the most probable true experts
    assert torch.equal(c[:, :2], topk[:, :2])
    prev = build_predictor("previous_token", None, dims)
    pc = candidate_sets(prev, b, 6, "token")[0]
    assert (pc[[0, 10]] == -1).all()  # first token of each sample: no candidates
    assert (pc[:, 4:] == -1).all()  # never more than the previous token's K experts
    loop = sum(len(set(topk[i].tolist()) & set(topk[i - 1].tolist())) / k
               for i in range(t) if i not in (0, 10)) / t
    assert expert_recall(topk, pc) == pytest.approx(loop)


# --------------------------------------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("rec")
    cfg = copy.deepcopy(load_config(REPO / "config" / "smoke.yaml"))
    cfg["predictors"]["training"]["batch_tokens"] = 64
    corpus = make_trace(root / "corpus", n_samples=30)
    workload = make_trace(root / "gsm8k", workload="gsm8k", n_samples=12, seed=5)
    dirs = {}
    for m in ("specprefetch", "fate", "previous_token", "frequency", "oracle"):
        train_predictor(cfg, MODEL, m, corpus, root / "pred" / m)
        dirs[m] = root / "pred" / m
    return {"cfg": cfg, "root": root, "trace": workload, "dirs": dirs}


def test_evaluate_recall_outputs(setup: dict) -> None:
    cfg, root = setup["cfg"], setup["root"]
    out = root / "recall" / "gsm8k.csv"
    df = evaluate_recall(cfg, MODEL, "gsm8k", setup["trace"], setup["dirs"], out)
    assert list(pd.read_csv(out).columns) == ["model", "workload", "method", "seed", "M", "expert_recall",
                                              "n_tokens"]
    budgets = budgets_for(cfg, MODEL)
    assert budgets == [2, 4, 6]
    assert len(df) == len(setup["dirs"]) * len(budgets)
    assert df["expert_recall"].between(0, 1).all()
    r = df.set_index(["method", "M"])["expert_recall"]
    assert r["oracle", 4] == pytest.approx(1.0) and r["oracle", 2] == pytest.approx(0.5)
    assert (df[df["M"] == 2]["expert_recall"] <= 0.5 + 1e-9).all()  # token level: R@K/2 <= 50%
    assert r["fate", 6] > r["frequency", 6]  # the next gate is informative on this trace
    for m in setup["dirs"]:
        assert r[m, 2] <= r[m, 4] <= r[m, 6] + 1e-12  # nested candidate sets
    layers = pd.read_csv(per_layer_path(out))
    assert list(layers.columns) == ["model", "workload", "method", "seed", "M", "layer", "expert_recall"]
    assert sorted(layers["layer"].unique()) == [1, 2]
    mean = layers.groupby(["method", "M"])["expert_recall"].mean()
    for (m, M), v in mean.items():
        assert v == pytest.approx(r[m, M], abs=1e-5)
    assert (root / "recall" / "gsm8k.provenance.json").is_file()


def test_evaluate_recall_batch_mode(setup: dict) -> None:
    df = evaluate_recall(setup["cfg"], MODEL, "gsm8k", setup["trace"], {"oracle": setup["dirs"]["oracle"]},
                         setup["root"] / "b.csv", candidates="batch")
    r = df.set_index("M")["expert_recall"]
    assert r[4] < 1.0 and r[2] < r[4]  # one set per sample cannot cover every token's own top-K


def test_evaluate_recall_rejects_mismatches(setup: dict, tmp_path: Path) -> None:
    cfg = setup["cfg"]
    with pytest.raises(SpecPrefetchError, match="workload 'gsm8k'"):
        evaluate_recall(cfg, MODEL, "ocrbench", setup["trace"], setup["dirs"], tmp_path / "x.csv")
    with pytest.raises(SpecPrefetchError, match="holds a 'fate' predictor"):
        evaluate_recall(cfg, MODEL, "gsm8k", setup["trace"], {"oracle": setup["dirs"]["fate"]}, tmp_path / "x.csv")
    other = make_trace(tmp_path / "wide", workload="gsm8k", D=16, n_samples=3)
    with pytest.raises(SpecPrefetchError, match="hidden_size=32 but trace"):
        evaluate_recall(cfg, MODEL, "gsm8k", other, {"fate": setup["dirs"]["fate"]}, tmp_path / "x.csv")
    assert not (tmp_path / "x.csv").exists()


def test_gather_and_params(setup: dict) -> None:
    root, cfg = setup["root"], setup["cfg"]
    a = root / "g" / "a.csv"
    b = root / "g" / "b.csv"
    evaluate_recall(cfg, MODEL, "gsm8k", setup["trace"], {"fate": setup["dirs"]["fate"]}, a)
    evaluate_recall(cfg, MODEL, "gsm8k", setup["trace"], {"oracle": setup["dirs"]["oracle"]}, b)
    df = gather_recall([a, b], root / "g" / "recall.csv")
    assert len(df) == 6 and set(df["method"]) == {"fate", "oracle"}
    assert per_layer_path(root / "g" / "recall.csv").is_file()
    with pytest.raises(SpecPrefetchError, match="duplicate rows"):
        gather_recall([a, a], root / "g" / "dup.csv")
    params = gather_params(list(setup["dirs"].values()), root / "params.csv")
    assert list(params.columns) == ["model", "method", "trainable_params"]
    p = params.set_index("method")["trainable_params"]
    assert p["specprefetch"] == 2 * 16 * (32 + 16) and p["fate"] == 0


def test_cli_commands(setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert parse_predictor_args(["fate=/a", "oracle=b"]) == {"fate": Path("/a"), "oracle": Path("b")}
    with pytest.raises(SpecPrefetchError, match="METHOD=DIR"):
        parse_predictor_args(["fate"])
    cfg_path = REPO / "config" / "smoke.yaml"
    out = tmp_path / "cli.csv"
    rc = cli_main(["evaluate-recall", "--config", str(cfg_path), "--model", MODEL, "--workload", "gsm8k",
                   "--traces", str(setup["trace"]), "--predictor", f"oracle={setup['dirs']['oracle']}",
                   "--out", str(out)])
    assert rc == 0 and pd.read_csv(out)["expert_recall"].max() == pytest.approx(1.0)
    rc = cli_main(["gather-params", "--out", str(tmp_path / "p.csv"), str(setup["dirs"]["fate"])])
    assert rc == 0
    rc = cli_main(["train-predictor", "--config", str(cfg_path), "--model", MODEL, "--method", "frequency",
                   "--traces", str(tmp_path / "missing"), "--out", str(tmp_path / "f")])
    assert rc == 2 and "manifest.json: missing" in capsys.readouterr().err
