"""The paper profile's hub code paths against a local hub mirror (tests/hub_mirror.py), with the hub offline.

The mirror is an ``HF_HOME`` holding, under the paper's hub ids, the five benchmarks in their real column schemas
and a tiny random Qwen3-VL-MoE in transformers' format. Every check runs in a fresh interpreter started with
``HF_HOME=<mirror> HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1`` (huggingface_hub, datasets and evaluate read these at
import), so what loads can only come from the mirror: (a) each hub workload through ``prepare_workload`` (the
prepare_workload stage: ``datasets.load_dataset`` + lm-eval's ``doc_to_text`` where the harness has the task),
(b) lm-eval's upstream gsm8k / humaneval / chartqa tasks through its TaskManager, (c) ``load_bundle`` of the Qwen
model from its hub id, (d) ``specprefetch inspect-model`` with config/paper.yaml plus the tiny-model override.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hub_mirror as hm
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# The columns each benchmark has on the hub (dataset cards; lm-eval / lmms-eval task code reads them).
REAL_COLUMNS = {
    "openai/gsm8k": ["question", "answer"],
    "openai/openai_humaneval": ["task_id", "prompt", "canonical_solution", "test", "entry_point"],
    "echo840/OCRBench": ["dataset", "question", "question_type", "answer", "image"],
    "HuggingFaceM4/ChartQA": ["image", "query", "label", "human_or_machine"],
    "lmms-lab/HallusionBench": ["category", "subcategory", "visual_input", "set_id", "figure_id", "sample_note",
                                "question_id", "question", "gt_answer_details", "gt_answer", "filename", "image"],
}
WORKLOAD_REPO = {"gsm8k": "openai/gsm8k", "humaneval": "openai/openai_humaneval", "ocrbench": "echo840/OCRBench",
                 "chartqa": "HuggingFaceM4/ChartQA", "hallusionbench": "lmms-lab/HallusionBench"}
WORKLOAD_SPLIT = {"gsm8k": "test", "humaneval": "test", "ocrbench": "test", "chartqa": "test",
                  "hallusionbench": "image"}

def _env(mirror: dict[str, Any]) -> dict[str, str]:
    return hm.isolated_env(Path(mirror["hf_home"]))


@pytest.fixture(scope="module")
def paper_config(hub_mirror: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config/paper.yaml with the mirror's ``models.*`` overrides merged in (the CLI takes one --config)."""
    return hm.merged_paper_config(hub_mirror["config_overrides"], tmp_path_factory.mktemp("cfg") / "paper.yaml")


@pytest.fixture(scope="module")
def checks(hub_mirror: dict[str, Any], paper_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("checks")
    mirror_json = Path(hub_mirror["hf_home"]) / "mirror.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "hub_mirror_checks.py"), str(mirror_json),
                           str(paper_config), str(out)], env=_env(hub_mirror), cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "checks.json").read_text())
    res["_out"] = str(out)
    return res


def _ok(checks: dict, key: str) -> dict:
    entry = checks[key]
    assert entry["ok"], f"{key} failed: {entry.get('traceback', entry.get('error'))}"
    return entry


# ------------------------------------------------------------------------------------------ the mirror itself
def test_mirror_has_the_hub_cache_layout(hub_mirror: dict[str, Any]) -> None:
    home = Path(hub_mirror["hf_home"])
    for repo_id, info in hub_mirror["benchmarks"].items():
        repo = home / "hub" / f"datasets--{repo_id.replace('/', '--')}"
        assert (repo / "refs" / "main").read_text() == info["commit"] == hm.fake_commit("dataset", repo_id)
        snap = repo / "snapshots" / info["commit"]
        files = [p for p in snap.rglob("*") if p.is_symlink()]
        assert (snap / "README.md").is_symlink() and any(p.suffix == ".parquet" for p in files)
        assert all(p.resolve().parent == (repo / "blobs").resolve() for p in files)
        card = yaml.safe_load((snap / "README.md").read_text().split("---")[1])
        assert [f["name"] for f in card["dataset_info"]["features"]] == REAL_COLUMNS[repo_id]
        assert info["columns"] == REAL_COLUMNS[repo_id]
        # the processed cache a load_dataset run leaves: <org>___<snake_name>/<config>/0.0.0/<commit>/
        cache = Path(info["cache_dir"])
        assert cache.relative_to(home / "datasets").parts[2:] == ("0.0.0", info["commit"])
        assert json.loads((cache / "dataset_info.json").read_text())["config_name"] == info["config"]
        assert sorted(p.name for p in cache.glob("*.arrow")) == sorted(
            f"{cache.parts[-4].split('___')[1]}-{split}.arrow" for split in info["rows"])
    chart = Path(hub_mirror["benchmarks"]["HuggingFaceM4/ChartQA"]["snapshot"])
    card = yaml.safe_load((chart / "README.md").read_text().split("---")[1])
    feats = {f["name"]: f for f in card["dataset_info"]["features"]}
    assert feats["label"] == {"name": "label", "list": "string"} and feats["image"]["dtype"] == "image"
    assert feats["human_or_machine"]["dtype"]["class_label"]["names"] == {"0": "human", "1": "machine"}

    q = hub_mirror["models"][hm.QWEN_ID]
    snap = Path(q["snapshot"])
    assert snap.name == q["commit"] and (snap.parent.parent / "refs" / "main").read_text() == q["commit"]
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "vocab.json", "merges.txt", "preprocessor_config.json",
                 "video_preprocessor_config.json", "chat_template.json"):
        assert (snap / name).is_symlink(), name
    config = json.loads((snap / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"] and config["model_type"] == "qwen3_vl_moe"
    text = config["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"], text["num_hidden_layers"], text["hidden_size"]) == (
        hm.QWEN_TINY["n_experts"], hm.QWEN_TINY["top_k"], hm.QWEN_TINY["num_hidden_layers"],
        hm.QWEN_TINY["hidden_size"])
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded, like the real repository
    assert hub_mirror["config_overrides"]["models"][hm.QWEN_MODEL] == hm.QWEN_TINY
    metric = list((home / "modules/evaluate_modules/metrics/evaluate-metric--code_eval").glob("*/code_eval.py"))
    assert len(metric) == 1
    assert yaml.safe_load(Path(hub_mirror["override_file"]).read_text()) == hub_mirror["config_overrides"]


def test_datasets_offline_reads_the_processed_cache_not_the_hub_files(checks: dict) -> None:
    """Why the mirror has HF_HOME/datasets/: with only the hub file cache (what `hf download` leaves), datasets 5
    offline cannot load the benchmark, and the project's error says which dataset and how to fix it."""
    res = _ok(checks, "hub_cache_alone")
    assert not res["loaded"]
    assert "openai/gsm8k" in res["error"] and "HF_HOME/datasets" in res["error"] and "generator: local" in res["error"]


def test_checks_ran_offline_against_the_mirror(checks: dict, hub_mirror: dict[str, Any]) -> None:
    env = _ok(checks, "environment")
    home = Path(hub_mirror["hf_home"])
    assert env["hub_offline"] and env["datasets_offline"]
    assert Path(env["hf_hub_cache"]) == home / "hub" and Path(env["datasets_cache"]) == home / "datasets"


# ------------------------------------------------------------------------------------------ (a) workloads
@pytest.mark.parametrize("name", list(WORKLOAD_REPO))
def test_hub_workload_loads_and_maps(checks: dict, hub_mirror: dict[str, Any], name: str) -> None:
    res = _ok(checks, "workloads")["workloads"][name]
    bench = hub_mirror["benchmarks"][WORKLOAD_REPO[name]]
    rows = bench["rows"][WORKLOAD_SPLIT[name]]
    assert res["n"] == res["manifest_n"] == len(rows) and res["images_exist"]
    samples = res["samples"]
    assert all(s["source"].startswith(f"hub {WORKLOAD_REPO[name]} ") and "revision=main" in s["source"]
               for s in samples)
    assert all("<image>" not in s["prompt"] and "<|image_pad|>" not in s["prompt"] for s in samples)
    has_image = [s["image"] is not None for s in samples]
    assert has_image == [bool(r.get("image")) for r in rows]
    for s, r in zip(samples, rows):
        if name == "gsm8k":  # lm-eval gsm8k's doc_to_text; reference the worked solution; meta the final number
            assert s["prompt"] == f"Question: {r['question']}\nAnswer:" and s["reference"] == r["answer"]
            assert s["meta"]["answer"] == r["answer"].split("####")[-1].strip().replace(",", "")
        elif name == "humaneval":
            assert (s["prompt"], s["reference"]) == (r["prompt"], r["canonical_solution"])
            assert (s["meta"]["task_id"], s["meta"]["entry_point"]) == (r["task_id"], r["entry_point"])
        elif name == "ocrbench":  # lmms-eval's ocrbench_doc_to_text: the stripped question; answer is a list
            assert s["prompt"] == r["question"].strip() and s["reference"] == r["answer"][0]
            assert s["meta"]["answers"] == r["answer"] and s["meta"]["question_type"] == r["question_type"]
        elif name == "chartqa":  # lm-eval chartqa's doc_to_text without its <image>; target label[0]
            assert s["prompt"].startswith(r["query"] + "\nAnalyze the image") and "Final Answer:" in s["prompt"]
            assert s["reference"] == r["label"][0]
            assert s["meta"]["human_or_machine"] == ["human", "machine"][r["human_or_machine"]]
        else:  # hallusionbench: gt_answer "1"/"0" -> Yes/No
            assert s["prompt"] == r["question"] and s["reference"] == {"1": "Yes", "0": "No"}[r["gt_answer"]]
            assert s["meta"]["category"] == r["category"] and s["meta"]["question_id"] == r["question_id"]


# ------------------------------------------------------------------------------------------ (b) lm-eval tasks
@pytest.mark.parametrize("task", ["gsm8k", "humaneval", "chartqa"])
def test_lm_eval_upstream_task_reads_the_mirror(checks: dict, hub_mirror: dict[str, Any], task: str) -> None:
    res = _ok(checks, "lm_eval")["tasks"][task]
    repo = {"gsm8k": "openai/gsm8k", "humaneval": "openai/openai_humaneval", "chartqa": "HuggingFaceM4/ChartQA"}[task]
    bench = hub_mirror["benchmarks"][repo]
    assert res["dataset_path"] == repo and res["n_test"] == len(bench["rows"]["test"]) and res["n_instances"] == 1
    assert res["doc_keys"] == sorted(REAL_COLUMNS[repo])
    first = bench["rows"]["test"][0]
    if task == "gsm8k":  # 5-shot from the train split: the request context holds train questions
        assert res["dataset_name"] == "main" and res["n_train"] == len(bench["rows"]["train"])
        assert res["doc_to_text"] == f"Question: {first['question']}\nAnswer:"
        assert res["request_context"].endswith(res["doc_to_text"])
        assert sum(r["question"] in res["request_context"] for r in bench["rows"]["train"]) == 5
    elif task == "humaneval":
        assert res["doc_to_text"] == first["prompt"]
        assert res["doc_to_target"] == f"{first['test']}\ncheck({first['entry_point']})"
    else:
        assert res["doc_to_text"].startswith(f"<image>{first['query']}") and res["doc_to_target"] == first["label"][0]
        assert res["n_images"] == 1 and (res["image_type"].endswith("ImageFile") or res["image_type"] == "Image")


# ------------------------------------------------------------------------------------------ (c) the model
def test_qwen_mirror_checkpoint_loads_through_the_hub_cache(checks: dict, hub_mirror: dict[str, Any]) -> None:
    res = _ok(checks, "qwen_pieces")
    assert Path(res["resolved_config"]).parent == Path(hub_mirror["models"][hm.QWEN_ID]["snapshot"])
    assert res["model_class"] == "Qwen3VLMoeForConditionalGeneration" and res["dtype"] == "torch.bfloat16"
    r = res["routing"]
    assert (r["arch"], r["n_experts"], r["top_k"], r["hidden_size"], r["n_moe_layers"]) == (
        "qwen3_vl_moe", hm.QWEN_TINY["n_experts"], hm.QWEN_TINY["top_k"], hm.QWEN_TINY["hidden_size"],
        hm.QWEN_TINY["num_hidden_layers"])
    assert res["tokenizer_class"] == "Qwen2Tokenizer" and all(len(v) == 1 for v in res["specials"].values())
    assert res["chat_text"] == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?"
                                "<|im_end|>\n<|im_start|>assistant\n")
    assert res["n_image_tokens"] >= 64  # min_pixels 65536 of Qwen3-VL's preprocessor: >= 16x16 patches, merged 2x2
    assert res["logits_shape"][-1] == res["vocab"]


def test_load_bundle_from_the_hub_id(checks: dict) -> None:
    res = _ok(checks, "qwen_bundle")
    assert res["kind"] == "hf" and res["model_dir"] is None and res["model_class"] == \
        "Qwen3VLMoeForConditionalGeneration"
    r = res["routing"]
    assert (r["n_experts"], r["top_k"], r["n_moe_layers"]) == (
        hm.QWEN_TINY["n_experts"], hm.QWEN_TINY["top_k"], hm.QWEN_TINY["num_hidden_layers"])
    assert res["n_image_tokens"] > 0 and res["logits_shape"][1] == res["n_tokens"]


def test_load_bundle_deepseek_vl2_from_the_hub_id(checks: dict, hub_mirror: dict[str, Any]) -> None:
    if hm.DEEPSEEK_ID not in hub_mirror["models"]:
        pytest.fail(f"no DeepSeek-VL2 reference checkpoint at {hm.DEEPSEEK_CHECKPOINT}")
    res = _ok(checks, "deepseek_bundle")
    snap = Path(hub_mirror["models"][hm.DEEPSEEK_ID]["snapshot"])
    assert snap.name == hm.deepseek_revision() and (snap.parent.parent / "refs" / "main").read_text() == snap.name
    want = hub_mirror["config_overrides"]["models"][hm.DEEPSEEK_MODEL]
    r = res["routing"]
    assert res["kind"] == "hf" and res["model_dir"] is None
    n_moe = want["num_hidden_layers"] - want["first_dense_layers"]
    assert (r["n_experts"], r["top_k"], r["n_shared_experts"], r["n_moe_layers"]) == (
        want["n_experts"], want["top_k"], want["n_shared_experts"], n_moe)
    assert res["n_image_tokens"] > 0 and res["logits_shape"][1] == res["n_tokens"]


# ------------------------------------------------------------------------------------------ (d) the CLI
@pytest.mark.parametrize("model", [hm.QWEN_MODEL, hm.DEEPSEEK_MODEL])
def test_inspect_model_cli_on_the_mirror(model: str, hub_mirror: dict[str, Any], paper_config: Path) -> None:
    """`specprefetch inspect-model` on both paper models, loaded by hub id from the mirror."""
    if model == hm.DEEPSEEK_MODEL and hm.DEEPSEEK_ID not in hub_mirror["models"]:
        pytest.fail(f"no DeepSeek-VL2 reference checkpoint at {hm.DEEPSEEK_CHECKPOINT}")
    proc = subprocess.run([sys.executable, "-m", "specprefetch", "inspect-model", "--config", str(paper_config),
                           "--model", model], env=_env(hub_mirror), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    want = hub_mirror["config_overrides"]["models"][model]
    cls = {hm.QWEN_MODEL: "Qwen3VLMoeForConditionalGeneration", hm.DEEPSEEK_MODEL: "DeepseekVL2ForCausalLM"}[model]
    assert info["kind"] == "hf" and info["model_class"] == cls
    assert (info["n_experts"], info["top_k"], info["hidden_size"], info["n_moe_layers"]) == (
        want["n_experts"], want["top_k"], want["hidden_size"], want["num_hidden_layers"] - want["first_dense_layers"])
