"""The checks of tests/test_hub_mirror.py, run in a fresh interpreter whose environment points at the mirror.

huggingface_hub, datasets, evaluate and transformers read ``HF_HOME`` / ``HF_HUB_OFFLINE`` when imported, so a
pytest process that has imported them already cannot be redirected; this script is started with the mirror's
environment (``hub_mirror.offline_env``) and writes one JSON document of observations, which the tests assert on.

    python tests/hub_mirror_checks.py MIRROR_JSON CONFIG_YAML OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import hub_mirror  # noqa: E402

PAPER_WORKLOADS = ("gsm8k", "humaneval", "ocrbench", "chartqa", "hallusionbench")
LM_EVAL_TASKS = ("gsm8k", "humaneval", "chartqa")


def _guard(out: dict[str, Any], key: str, fn: Any) -> None:
    """Run one check; its result (or its error, with the traceback) goes under ``out[key]``."""
    t = time.perf_counter()
    try:
        out[key] = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
        out[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out[key]["seconds"] = round(time.perf_counter() - t, 2)


def check_environment(mirror: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import huggingface_hub.constants as hf

    return {"hf_hub_cache": str(hf.HF_HUB_CACHE), "hub_offline": bool(hf.HF_HUB_OFFLINE),
            "datasets_cache": str(datasets.config.HF_DATASETS_CACHE),
            "datasets_offline": bool(datasets.config.HF_HUB_OFFLINE)}


def check_workloads(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """(a) ``prepare_workload`` (the prepare_workload stage) on each hub workload, read back in workload format."""
    from specprefetch.data.workloads import prepare_workload, read_workload

    res: dict[str, Any] = {}
    for name in PAPER_WORKLOADS:
        t = time.perf_counter()
        target = out_dir / "workloads" / name
        prepare_workload(cfg, name, target)
        samples = read_workload(target)
        manifest = json.loads((target / "manifest.json").read_text())
        res[name] = {
            "n": len(samples), "manifest_n": manifest["n_samples"], "n_images": manifest["n_images"],
            "images_exist": all((target / s.image).is_file() for s in samples if s.image),
            "samples": [{"id": s.id, "prompt": s.prompt, "reference": s.reference, "image": s.image,
                         "source": s.source, "meta": s.meta} for s in samples],
            "seconds": round(time.perf_counter() - t, 2),
        }
    return {"workloads": res}


def check_lm_eval_tasks() -> dict[str, Any]:
    """(b) lm-eval's upstream tasks (its own TaskManager and task YAMLs) build and read their docs offline."""
    from specprefetch.data.hub import _task_manager

    tm = _task_manager()  # lm-eval's TaskManager(); shared with (a) so its registry is indexed once
    tasks = tm.load(list(LM_EVAL_TASKS))["tasks"]
    res: dict[str, Any] = {}
    for name in LM_EVAL_TASKS:
        task = tasks[name]
        docs = list(task.test_docs())
        doc = docs[0]
        task.build_all_requests(limit=1, rank=0, world_size=1)
        inst = task.instances[0]
        entry: dict[str, Any] = {
            "dataset_path": task.config.dataset_path, "dataset_name": task.config.dataset_name,
            "n_test": len(docs), "doc_keys": sorted(doc), "doc_to_text": task.doc_to_text(doc),
            "doc_to_target": str(task.doc_to_target(doc)), "request_context": str(inst.args[0]),
            "n_instances": len(task.instances),
        }
        if task.has_training_docs():
            entry["n_train"] = len(list(task.training_docs()))
        if name == "chartqa":
            visual = task.doc_to_image(doc)
            entry["n_images"] = len(visual)
            entry["image_type"] = type(visual[0]).__name__
        res[name] = entry
    return {"tasks": res}


def check_qwen_pieces(cfg: dict[str, Any]) -> dict[str, Any]:
    """The mirrored Qwen3-VL-MoE repository through transformers' hub cache, piece by piece (no processor class):
    the files resolve to the mirror's snapshot, the model loads with the paper's kwargs and its routing matches
    the overridden config, the tokenizer has Qwen's specials and chat template, and an image forward runs."""
    import torch
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    from specprefetch.models.loading import check_routing_matches
    from specprefetch.models.routing import discover_routing

    mcfg = cfg["models"][hub_mirror.QWEN_MODEL]
    rev = mcfg["revision"]
    resolved = try_to_load_from_cache(mcfg["hub_id"], "config.json", revision=rev)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        mcfg["hub_id"], revision=rev, dtype=torch.bfloat16, device_map=mcfg.get("device_map"))
    spec = discover_routing(model)
    check_routing_matches(spec, mcfg, hub_mirror.QWEN_MODEL)
    tok = AutoTokenizer.from_pretrained(mcfg["hub_id"], revision=rev)
    ip = AutoImageProcessor.from_pretrained(mcfg["hub_id"], revision=rev)
    specials = {t: tok(t, add_special_tokens=False)["input_ids"] for t in
                ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "What is shown?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    from PIL import Image

    pix = ip(images=[Image.new("RGB", (96, 64), "white")], return_tensors="pt")
    n_img = int(pix["image_grid_thw"].prod()) // (ip.merge_size ** 2)
    pad = model.config.image_token_id
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n_img), add_special_tokens=False,
              return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix["pixel_values"],
                       image_grid_thw=pix["image_grid_thw"], mm_token_type_ids=(ids == pad).to(torch.int32)).logits
    return {"resolved_config": str(resolved), "model_class": type(model).__name__, "dtype": str(model.dtype),
            "routing": spec.describe(), "tokenizer_class": type(tok).__name__, "specials": specials,
            "chat_text": text, "image_processor_class": type(ip).__name__, "n_image_tokens": n_img,
            "logits_shape": list(logits.shape), "vocab": len(tok)}


def check_load_bundle(cfg: dict[str, Any], model_name: str, workload_dir: Path | None) -> dict[str, Any]:
    """(c) ``load_bundle`` with source hub and no path (the hub id at the configured revision), then one
    encoded sample of a prepared workload through the model."""
    import torch

    from specprefetch.data.workloads import read_workload
    from specprefetch.models.loading import encode_sample, load_bundle

    bundle = load_bundle(cfg, model_name)
    res: dict[str, Any] = {"kind": bundle.kind, "model_class": type(bundle.model).__name__,
                           "processor_class": type(bundle.processor).__name__, "model_dir": bundle.model_dir,
                           "routing": bundle.routing.describe()}
    if workload_dir is not None:
        sample = next(s for s in read_workload(workload_dir) if s.image)
        enc = encode_sample(bundle, sample, workload_dir)
        with torch.no_grad():
            logits = bundle.model(**enc.to(bundle.device).kwargs).logits
        res.update(n_tokens=enc.length, n_image_tokens=int(enc.is_image.sum()), logits_shape=list(logits.shape))
    return res


def check_hub_file_cache_alone(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Offline, datasets 5 does not read the hub file cache (what ``hf download`` fills): with the processed
    cache pointed at an empty directory (the hub cache still in place), the load fails with the project's error."""
    import datasets

    from specprefetch.data.hub import load_hub_dataset
    from specprefetch.io import SpecPrefetchError

    before = datasets.config.HF_DATASETS_CACHE
    empty = out_dir / "empty_datasets_cache"
    empty.mkdir()
    datasets.config.HF_DATASETS_CACHE = empty
    try:
        load_hub_dataset("gsm8k", cfg["workloads"]["gsm8k"]["dataset"])
    except SpecPrefetchError as exc:
        return {"loaded": False, "error": str(exc)}
    finally:
        datasets.config.HF_DATASETS_CACHE = before
    return {"loaded": True}


def main(argv: list[str]) -> int:
    mirror = json.loads(Path(argv[0]).read_text())
    config_path, out_dir = Path(argv[1]), Path(argv[2])
    from specprefetch.config import load_config

    cfg = load_config(config_path)
    out: dict[str, Any] = {}
    _guard(out, "environment", lambda: check_environment(mirror))
    _guard(out, "workloads", lambda: check_workloads(cfg, out_dir))
    _guard(out, "lm_eval", check_lm_eval_tasks)
    _guard(out, "qwen_pieces", lambda: check_qwen_pieces(cfg))
    chart = out_dir / "workloads" / "chartqa"
    chart_dir = chart if (chart / "manifest.json").is_file() else None
    _guard(out, "qwen_bundle", lambda: check_load_bundle(cfg, hub_mirror.QWEN_MODEL, chart_dir))
    _guard(out, "hub_cache_alone", lambda: check_hub_file_cache_alone(cfg, out_dir))
    if hub_mirror.DEEPSEEK_ID in mirror["models"]:
        _guard(out, "deepseek_bundle", lambda: check_load_bundle(cfg, hub_mirror.DEEPSEEK_MODEL, chart_dir))
    (out_dir / "checks.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
