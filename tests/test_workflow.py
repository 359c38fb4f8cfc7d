"""The Snakemake DAG: dry runs plan the whole DAG for every profile, bad config stops before any job."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def snakemake(workdir: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def job_counts(output: str) -> dict[str, int]:
    block = output.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", block, re.M)}


# Per profile: 5 workloads, 2 models x (corpus + 5 workloads) trace sets of traces.scatter shards each, gathered
# where the whole set is read (the corpus for training, the simulator's workloads), 2 x 9 predictors (the 5 learned
# ones once per seed: seeds(n) jobs per model), recall per
# shard, the stand-in realism over every workload's shards, runtime benchmarks per device model, 6 tables (Table 0: the
# realism), 10 figures (look-ahead, Pareto, budget rules and pre-attention beyond the paper), the look-ahead recall per
# shard; the PDF only where pdflatex is installed.
COMMON = {"prepare_workload": 5, "prepare_corpus": 1, "check_disjoint": 1,
          "train_predictor": 18, "gather_recall": 1, "gather_params": 1, "measure_predictor_cost": 1,
          "gather_lookahead": 1,
          "measure_realism": 1,
          "render_table": 6, "render_figure": 10, "collect_device_benchmarks": 1, "compare_with_paper": 1,
          "write_preview": 1, "archive_results": 1, "write_numbers": 1, "paper_tables": 1,
          **({"compile_preview": 1} if shutil.which("pdflatex") else {})}


def traces(scatter: int, gathered: int, corpus: bool = True) -> dict[str, int]:
    return {"extract_traces": (12 if corpus else 10) * scatter, "evaluate_recall": 10 * scatter,
            "evaluate_lookahead": 10 * scatter, "gather_traces": gathered}


def seeds(n: int, ahead: int) -> dict[str, int]:
    """train_predictor jobs with predictors.seeds = n: 2 models x (5 learned methods x n seeds + 4 training-free),
    plus SpecPrefetch's n seeds and FATE at each of the ``ahead`` (model, distance >= 2) pairs the models have."""
    return {"train_predictor": 2 * (5 * n + 4) + ahead * (n + 1)}


DEVICE_RULES = ("build_expert_store", "profile_window", "bench_runtime", "simulate_device", "validate_simulator",
                "evaluate_offloaded")
STAND_INS = {"train_tokenizer": 1, "pretrain_stand_in": 2, **{r: 2 for r in DEVICE_RULES}}
def variants(n: int) -> dict[str, int]:
    """profile_window, bench_runtime and validate_simulator per (model, variant): each model's default plus ``n``
    device.variants runs (the bandwidth emulation's storage experiment, FIFO's sweep) of the models whose
    experiments they measure."""
    return {"profile_window": n, "bench_runtime": n, "validate_simulator": n}


EXPECTED = {
    # simulator: gsm8k, chartqa; variants: the DeepSeek stand-in's (the Qwen stand-in runs main only)
    # look-ahead d = 2, 3 on both models; in the smoke profile only Qwen's 3 MoE layers have a pair at d = 2
    "config/config.yaml": {**COMMON, **STAND_INS, **traces(1, 2 + 2 * 2), **seeds(3, 4), **variants(2 + 2)},
    "config/smoke.yaml": {**COMMON, **STAND_INS, **traces(2, 2 + 2 * 1), **seeds(2, 1), **variants(2 + 4)},
    # hub checkpoints: no tokenizer, no stand-in pretraining; predictors train online (no corpus traces);
    # the runtime benchmarks DeepSeek-VL2-Tiny only (4-bit experts, as the paper)
    "config/paper.yaml": {**COMMON, **traces(8, 1, corpus=False), **seeds(1, 4), **{r: 1 for r in DEVICE_RULES},
                          **variants(1 + 2)},
}


@pytest.mark.parametrize("profile", list(EXPECTED))
def test_dry_run_plans_whole_dag(tmp_path: Path, profile: str) -> None:
    res = snakemake(tmp_path, "-n", "--cores", "1", "paper_tables", "--configfile", str(ROOT / profile))
    assert res.returncode == 0, res.stderr + res.stdout
    assert job_counts(res.stdout) == EXPECTED[profile]


def test_the_extensions_overlay_adds_fig_batch(tmp_path: Path) -> None:
    """fig_batch is in the DAG only where a model runs the batch experiment: the extensions overlay's (the default's
    10 figures above), as a render job and an input of the comparison, the preview and the numbers."""
    res = snakemake(tmp_path, "-n", "--cores", "1", "paper_tables", "--configfile", str(ROOT / "config/config.yaml"),
                    str(ROOT / "config/overlays/extensions.yaml"))
    assert res.returncode == 0, res.stderr + res.stdout
    assert job_counts(res.stdout)["render_figure"] == COMMON["render_figure"] + 1
    assert "--figure fig_batch --runs results/device/runs.csv" in res.stdout
    assert "paper_tables/figures/fig_batch.json" in res.stdout.split("rule compare_with_paper:")[1].split("rule ")[0]


def test_bad_config_stops_before_any_job(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "config/smoke.yaml").read_text().replace("top_k: 4", "top_k: 40")
    bad.write_text(text)
    res = snakemake(tmp_path, "--cores", "1", "paper_tables", "--configfile", str(bad))
    assert res.returncode != 0
    err = res.stderr + res.stdout
    assert "models.tiny-qwen3-vl-moe.top_k" in err and "n_experts=16" in err
    assert not (tmp_path / "results").exists()


def test_every_rule_has_log_benchmark_and_resources() -> None:
    """The conventions the SLURM profile relies on: no rule without log, benchmark, threads, resources."""
    for smk in sorted((ROOT / "workflow/rules").glob("*.smk")):
        rules = re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]
        for body in rules:
            name = body.split(":")[0]
            assert re.match(r"^[a-z]+(_[a-z]+)+$", name), f"{smk.name}: rule {name} is not verb_object"
            for key in ("log:", "benchmark:", "threads:", "resources:", "shell:"):
                assert f"\n    {key}" in body, f"{smk.name}: rule {name} lacks {key}"


@pytest.mark.slow
def test_smoke_profile_end_to_end(tmp_path: Path) -> None:
    """The whole DAG on config/smoke.yaml, from nothing to the rendered tables, then a no-op rerun."""
    res = snakemake(tmp_path, "--cores", "2", "paper_tables", "--configfile", str(ROOT / "config/smoke.yaml"),
                    timeout=3000)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    out = tmp_path / "results"
    for name in ("gsm8k", "humaneval", "ocrbench", "chartqa", "hallusionbench"):
        assert (out / "workloads" / name / "manifest.json").exists()
    for model in ("tiny-qwen3-vl-moe", "tiny-deepseek-vl2"):
        assert (out / "models" / model / "train_log.json").exists()
        assert (out / "traces" / model / "corpus" / "manifest.json").exists()
    import json

    import pandas as pd

    assert json.loads((out / "workloads" / "disjointness.json").read_text())
    recall = pd.read_csv(out / "recall" / "recall.csv")
    assert set(recall.columns) >= {"model", "workload", "method", "M", "expert_recall", "n_tokens"}
    assert recall["expert_recall"].between(0, 1).all()
    oracle = recall[(recall.method == "oracle")]
    assert len(oracle) and (oracle["expert_recall"] > 0.99).any()  # the oracle's top-K covers everything at M >= K
    params = pd.read_csv(out / "predictors" / "params.csv")
    assert (params.set_index(["model", "method"]).loc[("tiny-qwen3-vl-moe", "fate"), "trainable_params"] == 0)
    runs = pd.read_csv(out / "device" / "runs.csv")
    assert {"off", "specprefetch", "resident"} <= set(runs["policy"])
    assert (runs["tokens_per_s"] > 0).all()
    tables = out / "paper_tables"
    for t in ("table1_recall", "table2_ablation", "table3_params", "table4_overhead", "table5_matched"):
        assert "\\begin{tabular}" in (tables / f"{t}.tex").read_text()
    assert (tables / "comparison.md").exists()
    # CI's table diff on the smoke profile, from scratch: every cell against the committed smoke rendering, with the
    # smoke profile's tolerances (recall within 1 pp, parameter counts exact; timings listed, never failing).
    diff = subprocess.run([sys.executable, "-m", "specprefetch", "diff-tables", str(ROOT / "tests/golden/smoke"),
                           str(tables), "--config", str(ROOT / "config/smoke.yaml")], capture_output=True, text=True)
    assert diff.returncode == 0 and "RESULT: OK" in diff.stdout, diff.stdout[-5000:] + diff.stderr[-2000:]
    # The Snakemake report holds the tables and figures with their captions.
    report = snakemake(tmp_path, "--report", str(tmp_path / "report.html"), "paper_tables", "--configfile",
                       str(ROOT / "config/smoke.yaml"))
    assert report.returncode == 0, (report.stdout + report.stderr)[-3000:]
    html = (tmp_path / "report.html").read_text()
    for part in ("table1_recall.tex", "fig4_budget.png", "comparison.md", "table5_matched.tex", "Figure 4."):
        assert part in html, part
    smoke = ("--configfile", str(ROOT / "config/smoke.yaml"))
    # Nothing left to do: a second run is a no-op.
    again = snakemake(tmp_path, "-n", "--cores", "1", "paper_tables", *smoke)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]
    # --forcerun render_table reruns the rendering and what depends on it, nothing upstream.
    forced = snakemake(tmp_path, "-n", "--cores", "1", "paper_tables", "--forcerun", "render_table", *smoke)
    assert forced.returncode == 0 and job_counts(forced.stdout) == {
        "render_table": 6, "compare_with_paper": 1, "write_numbers": 1, "write_preview": 1, "paper_tables": 1,
        **({"compile_preview": 1} if shutil.which("pdflatex") else {})}, forced.stdout[-3000:]
    kill_an_extraction_shard_and_resume(tmp_path, smoke)


def kill_an_extraction_shard_and_resume(workdir: Path, smoke: tuple[str, ...]) -> None:
    """A run that dies (SIGKILL, as a preempted job) while one extraction shard runs: no output is taken as
    complete, only that shard and what reads it are redone, and --rerun-incomplete finishes the DAG."""
    import signal
    import time

    shard = workdir / "results/trace_shards/tiny-qwen3-vl-moe/humaneval/1"
    recall = workdir / "results/recall/tiny-qwen3-vl-moe/humaneval"
    # as if the first run had not got that far: the shard and what was computed from it do not exist yet (Snakemake
    # does not remake a missing intermediate file whose consumers are up to date)
    shutil.rmtree(shard)
    for f in [*recall.glob("1[._]*"), *(workdir / "results/recall").glob("recall*.csv")]:
        f.unlink()
    job_log = workdir / "logs/extract_traces/tiny-qwen3-vl-moe/humaneval/1.log"
    job_log.unlink()
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), "--cores", "1", "paper_tables",
           *smoke]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not job_log.exists():  # the job's shell has started (its `tee` opened the log); the job takes seconds
            assert proc.poll() is None and time.monotonic() < deadline, "the extraction job never started"
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and its job, mid-run
        proc.wait()
    assert not shard.exists()  # nothing Snakemake would take as complete
    assert snakemake(workdir, "--unlock", *smoke).returncode == 0  # the killed run's lock on the directory
    plan = snakemake(workdir, "-n", "--cores", "1", "paper_tables", "--rerun-incomplete", *smoke)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-3000:]
    counts = job_counts(plan.stdout)
    assert counts["extract_traces"] == 1 and counts["evaluate_recall"] == 1 and counts["gather_recall"] == 1, counts
    assert not {"pretrain_stand_in", "train_predictor", "gather_traces", "prepare_workload"} & set(counts)
    done = snakemake(workdir, "--cores", "2", "paper_tables", "--rerun-incomplete", *smoke, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (shard / "manifest.json").is_file() and not list(shard.parent.glob(".1.*.tmp"))


@pytest.mark.slow
def test_between_workflow_cache_reuses_expensive_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`snakemake --cache`: the corpus and tokenizer made in one working directory are reused in another."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("SNAKEMAKE_OUTPUT_CACHE", str(cache))
    args = ("--cores", "1", "--configfile", str(ROOT / "config/smoke.yaml"), "--cache", "--", "results/tokenizer")
    first = snakemake(tmp_path / "w1", *args)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "Moving output file results/tokenizer to cache" in first.stdout + first.stderr
    second = snakemake(tmp_path / "w2", *args)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "output file results/corpus" in out and "from cache" in out, out[-3000:]
    assert (tmp_path / "w2" / "results" / "tokenizer" / "tokenizer.json").exists()
    assert not (tmp_path / "w2" / "benchmarks").exists()  # nothing ran; cached rules write no benchmark
