"""ExpertRecall of saved predictors on routing traces (Tables 1–3), and the gathering of the per-shard CSVs.

``evaluate_recall`` runs every predictor over one workload trace and writes ``recall.csv``-format rows (and the
per-layer file); ``gather_recall`` joins the CSVs of every (model, workload) and scatter shard, token-weighted;
``gather_params`` is Table 3's data. The metric itself is :mod:`specprefetch.metrics`.

Seeds: a learned method may be given once per seed index (``predictors.seeds``; each predictor's meta.json says
which); the trace is read once for all of them and every row carries its ``seed`` (training-free methods: 0).

Look-ahead (beyond the paper): a predictor of distance d (``dims.lookahead``) is scored on the pairs (l, l+d);
``by_lookahead`` writes the ``lookahead`` contract instead (a ``lookahead`` column, a method once per seed and
distance, no per-layer file): ``results/recall/lookahead.csv``, ``fig_lookahead``'s data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import torch
from torch import Tensor
from tqdm import tqdm

from specprefetch.contracts import (
    LOOKAHEAD_COLUMNS,
    PARAM_COLUMNS,
    PER_LAYER_COLUMNS,
    RECALL_COLUMNS,
    check_csv,
    read_doc,
)
from specprefetch.io import SpecPrefetchError, atomic_path, provenance, sha256_file, write_json_atomic
from specprefetch.metrics import aggregate_by_sample, recall_per_token, select_candidates
from specprefetch.predictors.base import Predictor, load_predictor, read_meta

log = logging.getLogger(__name__)
CandidateMode = Literal["token", "batch"]


def candidate_sets(predictor: Predictor, batch: Mapping[str, Any], m_max: int,
                   mode: CandidateMode = "token") -> list[Tensor]:
    """Per target layer, [T, m_max] candidate ids (prefixes give smaller budgets) for every token."""
    scores = predictor.priorities(batch, "token")
    out = []
    for s in scores:
        if mode == "token":
            out.append(select_candidates(s, m_max, predictor.empty_when_zero))
        elif mode == "batch":
            agg, groups = aggregate_by_sample(s, batch["sample_index"])
            out.append(select_candidates(agg, m_max, predictor.empty_when_zero)[groups])
        else:
            raise SpecPrefetchError(f"invalid recall.candidates {mode!r}: use 'token' or 'batch'")
    return out


# --------------------------------------------------------------------------------------------- evaluation


def _check_predictor(meta: Mapping[str, Any], pred_dir: Path, model_name: str, reader: Any) -> None:
    """A predictor must belong to the model and fit the trace's shapes; say which file is wrong."""
    where = Path(pred_dir) / "meta.json"
    if meta.get("model") not in (None, model_name):
        raise SpecPrefetchError(f"{where}: predictor of model {meta.get('model')!r}, evaluating {model_name!r}")
    dims = meta["dims"]
    expect = {"n_layers": reader.n_layers, "hidden_size": reader.hidden_size, "n_experts": reader.n_experts,
              "top_k": reader.top_k}
    for k, v in expect.items():
        if int(dims.get(k, -1)) != int(v):
            raise SpecPrefetchError(f"{where}: dims.{k}={dims.get(k)} but trace {reader.dir} has {v}")


def _open_eval_trace(trace_dir: Path, model_name: str, workload: str) -> Any:
    """The workload trace, verified, and checked to be of this model and workload (its manifest says so)."""
    from specprefetch.traces.store import TraceReader

    reader = TraceReader(trace_dir, verify=True)
    man = reader.manifest
    if man.get("model") not in (None, model_name):
        raise SpecPrefetchError(f"{Path(trace_dir) / 'manifest.json'}: trace of model {man.get('model')!r}, "
                                f"evaluating {model_name!r}")
    if man.get("workload") not in (None, workload):
        raise SpecPrefetchError(f"{Path(trace_dir) / 'manifest.json'}: trace of workload {man.get('workload')!r}, "
                                f"expected {workload!r}")
    return reader


PredictorKey = tuple[str, int, int]  # (method, seed index, look-ahead distance)


def predictor_pairs(predictor_dirs: Mapping[str, Path] | Sequence[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """``{method: dir}`` or ``[(method, dir), ...]`` (a method once per seed) as a list of pairs."""
    return list(predictor_dirs.items()) if isinstance(predictor_dirs, Mapping) else list(predictor_dirs)


def seed_of(meta: Mapping[str, Any], where: Path) -> int:
    """A saved predictor's seed index (meta.json ``seed_index``; absent in single-seed predictors: 0)."""
    k = meta.get("seed_index", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise SpecPrefetchError(f"{where}: seed_index must be an integer >= 0, got {k!r}")
    return k


def _load_predictors(predictor_dirs: Sequence[tuple[str, Path]], model_name: str, reader: Any,
                     device: torch.device) -> tuple[dict[PredictorKey, Predictor], dict[str, Any]]:
    """Load every predictor onto ``device`` after checking it is the method it is given as and fits the model and
    the trace, keyed by (method, seed index, look-ahead); return them with what the provenance records of each
    (directory, weights digest, config hash), keyed ``method`` (seed 0, look-ahead 1), ``method/seed<k>`` and/or
    ``method/d<d>``."""
    preds: dict[PredictorKey, Predictor] = {}
    metas: dict[str, Any] = {}
    for method, pdir in predictor_dirs:
        meta = read_meta(pdir)
        where = Path(pdir) / "meta.json"
        if meta["method"] != method:
            raise SpecPrefetchError(f"{where}: holds a {meta['method']!r} predictor, given as {method!r}")
        _check_predictor(meta, Path(pdir), model_name, reader)
        pred = load_predictor(pdir, map_location=device)
        key = (method, seed_of(meta, where), pred.dims.lookahead)
        if key in preds:
            raise SpecPrefetchError(f"{where}: {method} seed {key[1]} look-ahead {key[2]} given twice")
        preds[key] = pred
        name = "/".join([method] + [f"seed{key[1]}"] * (key[1] != 0) + [f"d{key[2]}"] * (key[2] != 1))
        metas[name] = {"dir": str(pdir), "sha256": meta["weights"]["sha256"], "config_hash": meta.get("config_hash")}
    return preds, metas


def _count_hits(preds: Mapping[PredictorKey, Predictor], reader: Any, budgets: list[int], mode: CandidateMode,
                batch_tokens: int, device: torch.device, desc: str) -> tuple[dict[PredictorKey, Tensor], int]:
    """One pass over the trace: per predictor, the summed per-token recall of each budget and pair
    (``[len(budgets), L-d]``, float64), and the number of tokens. Candidates are drawn once at the largest budget;
    a smaller budget is their prefix."""
    from specprefetch.predictors.data import batch_to, iter_trace_batches

    m_max = max(budgets)
    hits = {k: torch.zeros(len(budgets), p.dims.n_pairs, dtype=torch.float64) for k, p in preds.items()}
    n_tokens = 0
    with torch.no_grad():
        for batch in tqdm(iter_trace_batches(reader, batch_tokens), desc=desc, disable=None):
            batch = batch_to(batch, device)
            n_tokens += int(batch["token_ids"].shape[0])
            for method, pred in preds.items():
                cands = candidate_sets(pred, batch, m_max, mode)
                for l, c in enumerate(cands):
                    true = batch["topk"][pred.dims.target(l)]
                    for j, m in enumerate(budgets):
                        hits[method][j, l] += float(recall_per_token(true, c[:, :m]).sum())
    return hits, n_tokens


def _recall_tables(hits: Mapping[PredictorKey, Tensor], n_tokens: int, budgets: list[int], model_name: str,
                   workload: str, by_lookahead: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The recall table (per method, seed, look-ahead and budget: the mean over target layers; the ``recall``
    contract's columns, or the ``lookahead`` contract's with ``by_lookahead``) and the per-layer table (``layer`` =
    target MoE ordinal l+d) from the summed hits: ExpertRecall is a mean over tokens."""
    rows, layer_rows = [], []
    for (method, seed, d), h in hits.items():
        for j, m in enumerate(budgets):
            per_layer = h[j] / n_tokens
            rows.append({"model": model_name, "workload": workload, "method": method, "seed": seed, "lookahead": d,
                         "M": m, "expert_recall": float(per_layer.mean()), "n_tokens": n_tokens})
            layer_rows += [{"model": model_name, "workload": workload, "method": method, "seed": seed, "M": m,
                            "layer": l + d, "expert_recall": float(v)} for l, v in enumerate(per_layer.tolist())]
    columns = LOOKAHEAD_COLUMNS if by_lookahead else RECALL_COLUMNS
    return pd.DataFrame(rows, columns=columns), pd.DataFrame(layer_rows, columns=PER_LAYER_COLUMNS)


def evaluate_recall(
    cfg: Mapping[str, Any],
    model_name: str,
    workload: str,
    trace_dir: Path,
    predictor_dirs: Mapping[str, Path] | Sequence[tuple[str, Path]],
    out_csv: Path,
    candidates: CandidateMode | None = None,
    batch_tokens: int = 8192,
    by_lookahead: bool = False,
) -> pd.DataFrame:
    """ExpertRecall@M of every predictor on one workload trace, for every budget of ``budgets_for``.

    Writes ``out_csv`` (model, workload, method, seed, M, expert_recall, n_tokens) and ``<stem>_per_layer.csv``
    (model, workload, method, seed, M, layer, expert_recall; ``layer`` = target MoE ordinal l+1), both atomically,
    plus ``<stem>.provenance.json``. ``predictor_dirs``: ``{method: dir}``, or ``(method, dir)`` pairs with a
    learned method once per seed index. ``by_lookahead``: predictors of several look-ahead distances, the
    ``lookahead`` contract's rows (a ``lookahead`` column) and no per-layer file; otherwise every predictor must
    predict one layer ahead (the paper's Tables 1-3). Returns the overall table.
    """
    from specprefetch.config import budgets_for

    if not predictor_dirs:
        raise SpecPrefetchError("evaluate_recall: no predictors given")
    reader = _open_eval_trace(trace_dir, model_name, workload)
    mode: CandidateMode = candidates or cfg["recall"]["candidates"]
    budgets = budgets_for(cfg, model_name)
    if max(budgets) > reader.n_experts:
        raise SpecPrefetchError(f"recall budget M={max(budgets)} > n_experts={reader.n_experts} of trace {trace_dir}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preds, metas = _load_predictors(predictor_pairs(predictor_dirs), model_name, reader, device)
    ahead = sorted(f"{m}/d{d}" for m, _, d in preds if d != 1)
    if ahead and not by_lookahead:
        raise SpecPrefetchError(f"evaluate_recall: {', '.join(ahead)} predict(s) more than one layer ahead; Tables "
                                "1-3 score the paper's next-layer predictors (look-ahead: evaluate-recall "
                                "--by-lookahead)")
    hits, n_tokens = _count_hits(preds, reader, budgets, mode, batch_tokens, device,
                                 desc=f"recall {model_name}/{workload}")
    if n_tokens == 0:
        raise SpecPrefetchError(f"trace {trace_dir} has no tokens")

    df, per_layer_df = _recall_tables(hits, n_tokens, budgets, model_name, workload, by_lookahead)
    out_csv = Path(out_csv)
    _write_csv(df, out_csv)
    if not by_lookahead:
        _write_csv(per_layer_df, per_layer_path(out_csv))
    write_json_atomic(out_csv.with_name(out_csv.stem + ".provenance.json"), {
        "model": model_name, "workload": workload, "candidates": mode, "budgets": budgets, "n_tokens": n_tokens,
        "trace": {"dir": str(trace_dir), "manifest_sha256": sha256_file(Path(trace_dir) / "manifest.json")},
        "scatter": reader.manifest.get("scatter"),
        "predictors": metas,
        "provenance": provenance({"recall": dict(cfg["recall"]), "model": dict(cfg["models"][model_name])}),
    })
    log.info("recall %s/%s: %d tokens, %s", model_name, workload, n_tokens,
             ", ".join(f"{r.method}{f'/seed{r.seed}' if r.seed else ''}"
                       f"{f'/d{r.lookahead}' if by_lookahead else ''}@{r.M}={r.expert_recall:.3f}"
                       for r in df.itertuples()))
    return df


def per_layer_path(out_csv: Path) -> Path:
    return Path(out_csv).with_name(Path(out_csv).stem + "_per_layer.csv")


def _write_csv(df: pd.DataFrame, target: Path) -> None:
    with atomic_path(target) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6f")


def _scatter_of(csv: Path) -> tuple[int, int]:
    """(index, count) of the trace scatter shard a recall CSV was evaluated on (0, 1 for a whole trace)."""
    prov = csv.with_name(csv.stem + ".provenance.json")
    info = (read_doc(prov, None, "recall provenance").get("scatter") if prov.is_file() else None) or {}
    if not isinstance(info, dict):
        raise SpecPrefetchError(f"{prov}: 'scatter' must be a mapping with index and count")
    try:
        return int(info.get("index", 0)), int(info.get("count", 1))
    except (TypeError, ValueError):
        raise SpecPrefetchError(f"{prov}: scatter index/count must be integers, got {info!r}") from None


def _token_weighted(frames: list[pd.DataFrame], key: list[str]) -> pd.DataFrame:
    """Join per-shard recall rows: ExpertRecall is a mean over tokens, so the token-weighted mean of the shards'
    values is the recall of the whole trace (exact in token candidate mode); ``n_tokens`` adds up."""
    df = pd.concat(frames, ignore_index=True)
    df["_hits"] = df["expert_recall"] * df["_w"]
    out = df.groupby(key, sort=False).agg(_hits=("_hits", "sum"), _w=("_w", "sum")).reset_index()
    out["expert_recall"] = out["_hits"] / out["_w"]
    return out


def gather_recall(csvs: Iterable[Path], out: Path, by_lookahead: bool = False) -> pd.DataFrame:
    """Concatenate per-(model, workload) recall CSVs into one table (and their per-layer files when all
    inputs have one). The CSVs of the scatter shards of one trace set (their provenance names shard i of N) are
    joined token-weighted, and must be shards 0..N-1 exactly; any other (model, workload, method, seed, M) key
    present twice is an error. ``by_lookahead``: the ``lookahead`` contract's CSVs, keyed by the distance too."""
    csvs = [Path(c) for c in csvs]
    if not csvs:
        raise SpecPrefetchError("gather_recall: no input CSVs")
    contract, columns = ("lookahead", LOOKAHEAD_COLUMNS) if by_lookahead else ("recall", RECALL_COLUMNS)
    key = ["model", "workload", "method", "seed", *(["lookahead"] if by_lookahead else []), "M"]
    frames = [check_csv(c, contract)[columns] for c in csvs]
    for c, f in zip(csvs, frames, strict=True):
        f["_w"] = f["n_tokens"].astype(float)
        f["_shard"], f["_count"] = _scatter_of(c)
    rows = pd.concat(frames, ignore_index=True)
    for k, g in rows.groupby(key, sort=False):
        n = int(g["_count"].iloc[0])
        if len(g) > 1 and (n == 1 or (g["_count"] != n).any() or sorted(g["_shard"]) != list(range(n))):
            raise SpecPrefetchError(f"gather_recall: duplicate rows for {dict(zip(key, k, strict=True))} in the "
                                    f"inputs (only the scatter shards 0..N-1 of one trace set may repeat a key)")
    df = _token_weighted(frames, key)
    df["n_tokens"] = df["_w"].round().astype(int)
    df = df[columns].sort_values(key, kind="stable").reset_index(drop=True)
    _write_csv(df, Path(out))
    layer_files = [per_layer_path(c) for c in csvs]
    if not by_lookahead and all(path.is_file() for path in layer_files):
        layer_frames = []
        for f, path in zip(frames, layer_files, strict=True):
            lf = check_csv(path, "per_layer")[PER_LAYER_COLUMNS]
            lf["_w"] = float(f["n_tokens"].iloc[0])
            layer_frames.append(lf)
        layers = _token_weighted(layer_frames, [*key, "layer"])[PER_LAYER_COLUMNS]
        layers = layers.sort_values([*key, "layer"], kind="stable").reset_index(drop=True)
        _write_csv(layers, per_layer_path(Path(out)))
    return df


def gather_params(predictor_dirs: Iterable[Path], out: Path) -> pd.DataFrame:
    """Table 3's data: ``model, method, trainable_params`` read from each saved predictor's meta.json."""
    rows = []
    for d in predictor_dirs:
        meta = read_meta(d)
        if "trainable_params" not in meta:
            raise SpecPrefetchError(f"{Path(d) / 'meta.json'}: missing key 'trainable_params'")
        rows.append({"model": meta.get("model"), "method": meta["method"],
                     "trainable_params": int(meta["trainable_params"])})
    if not rows:
        raise SpecPrefetchError("gather_params: no predictor directories")
    df = pd.DataFrame(rows, columns=PARAM_COLUMNS)
    dup = df[df.duplicated(["model", "method"], keep=False)]
    if not dup.empty:
        raise SpecPrefetchError(f"gather_params: {dict(dup.iloc[0][['model', 'method']])} given twice")
    df = df.sort_values(["model", "method"], kind="stable").reset_index(drop=True)
    _write_csv(df, Path(out))
    return df
