"""The paper profile's whole DAG, every rule, on a local Hugging Face hub mirror with the hub offline (issue 13).

``snakemake --cores 2 paper_tables --configfile config/paper.yaml <overrides>`` runs from an empty directory with
``HF_HOME=<mirror> HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1`` (tests/hub_mirror.py: the five benchmarks and the
corpus datasets in their real schemas, tiny random Qwen3-VL-MoE and DeepSeek-VL2 checkpoints under the paper's
repo ids), so every input comes from the hub code paths: ``datasets.load_dataset`` of the benchmarks and corpus,
``from_pretrained`` / our DeepSeek-VL2 loader by hub id, lm-eval's upstream gsm8k and humaneval tasks. The
overrides (``hub_mirror.paper_dag_overrides``) change sizes only. Checked: every rule of the DAG ran as often as
the dry run planned; the predictors trained online with DeepSpeed ZeRO-2 over gloo, bf16 autocast, the paper's
optimizer settings; the device stage ran DeepSeek-VL2-Tiny and the offloaded lm-eval scores equal the plain model's;
all five tables and the comparison rendered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hub_mirror as hm
import pandas as pd
import pytest
import yaml
from test_workflow import job_counts

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


@pytest.mark.slow
def test_paper_profile_dag_on_the_hub_mirror(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="the paper recipe's DeepSpeed ZeRO-2 needs the deepspeed extra")
    mirror = hm.write_hub_mirror_isolated(tmp_path / "hf_home")
    assert hm.DEEPSEEK_ID in mirror["models"], f"no DeepSeek-VL2 reference checkpoint at {hm.DEEPSEEK_CHECKPOINT}"
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(yaml.safe_dump(hm.paper_dag_overrides(mirror), sort_keys=False))
    work = tmp_path / "work"
    env = {k: v for k, v in hm.isolated_env(Path(mirror["hf_home"])).items() if k != "HF_ALLOW_CODE_EVAL"}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(work), "--cores", "2", "paper_tables",
           "--configfile", str(REPO / "config" / "paper.yaml"), str(overrides)]
    plan = subprocess.run([*cmd, "-n"], capture_output=True, text=True, timeout=600, env=env)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-5000:]
    planned = job_counts(plan.stdout)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-8000:]

    ran = {d.name: len(list(d.rglob("*.tsv"))) for d in (work / "benchmarks").iterdir()}
    missing = {rule: n for rule, n in planned.items() if rule != "paper_tables" and ran.get(rule) != n}
    assert not missing, f"rules planned but not run as often (planned: {missing}, ran: {ran})"
    assert {"prepare_corpus", "train_predictor", "extract_traces", "build_expert_store", "bench_runtime",
            "evaluate_offloaded", "compare_with_paper"} <= set(ran)

    out = work / "results"
    corpus = json.loads((out / "corpus" / "manifest.json").read_text())
    assert corpus["provenance"]["hub"], "the corpus came from the hub datasets"
    for model in (hm.QWEN_MODEL, hm.DEEPSEEK_MODEL):
        meta = json.loads((out / "predictors" / model / "specprefetch" / "meta.json").read_text())
        t = meta["training"]
        ds = t["distributed"]["deepspeed"]
        assert t["source"] == "online" and t["distributed"]["backend"] == "gloo" and ds["zero_stage"] == 2
        assert ds["torch_autocast"] and ds["torch_autocast_dtype"] == "bfloat16" and not ds["bf16_weights"]
        assert ds["optimizer_hparams"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        assert ds["gradient_clipping"] == 0.5
        assert len(set(t["distributed"]["param_sha256_by_rank"])) == 1, "both ranks hold the same weights"
    runs = pd.read_csv(out / "device" / "runs.csv")
    assert set(runs["model"]) == {hm.DEEPSEEK_MODEL} and {"off", "specprefetch", "resident"} <= set(runs["policy"])
    acc = pd.read_csv(out / "device" / "accuracy" / f"{hm.DEEPSEEK_MODEL}.csv")
    assert set(acc["task"]) == {"gsm8k", "humaneval"} and acc["equal_outputs"].all()
    tables = out / "paper_tables"
    for t in ("table1_recall", "table2_ablation", "table3_params", "table4_overhead", "table5_matched"):
        assert "\\begin{tabular}" in (tables / f"{t}.tex").read_text()
    assert (tables / "comparison.md").is_file()
