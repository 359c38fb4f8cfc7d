"""The paper profile's workloads: the real benchmarks from the Hugging Face hub, mapped to the workload format.

``datasets.load_dataset(path, name, split=..., revision=...)`` loads GSM8K, HumanEval, OCRBench, ChartQA or
HallusionBench; one small mapping function per benchmark turns a record into a ``Draft``. Where the
lm-evaluation-harness has the task (``lm_eval_task``: gsm8k, humaneval, chartqa) the prompt is the harness's
own ``doc_to_text`` of the record, so prompts are exactly what a harness user sees (image placeholders removed:
the model code inserts its own). When the hub is unreachable the error says which dataset failed and how to
use a local copy.
"""

from __future__ import annotations

import functools
import io
import logging
import re
from collections.abc import Callable
from typing import Any

from specprefetch.data.draft import Draft, seeded_order
from specprefetch.io import SpecPrefetchError

log = logging.getLogger(__name__)

Formatter = Callable[[dict[str, Any]], str]
IMAGE_PLACEHOLDERS = re.compile(r"<image(?:_\d+)?>\s*|<\|image_pad\|>|<\|vision_start\|>|<\|vision_end\|>")

# Known hub paths -> benchmark format; other paths (mirrors, local copies) are recognised by their columns.
KNOWN_PATHS = {
    "openai/gsm8k": "gsm8k", "gsm8k": "gsm8k",
    "openai/openai_humaneval": "humaneval", "openai_humaneval": "humaneval",
    "echo840/ocrbench": "ocrbench",
    "huggingfacem4/chartqa": "chartqa",
    "lmms-lab/hallusionbench": "hallusionbench",
}
FORMAT_COLUMNS = {  # checked in this order
    "humaneval": {"prompt", "canonical_solution", "test", "entry_point"},
    "chartqa": {"query", "label", "image"},
    "hallusionbench": {"question", "gt_answer"},
    "ocrbench": {"question", "answer", "image"},
    "gsm8k": {"question", "answer"},
}


def schema_of(dataset_path: str, columns: list[str] | set[str], known: dict[str, str],
              formats: dict[str, set[str]]) -> str | None:
    """A dataset's schema: by its known hub path, else the first of ``formats`` whose columns it has (None: none)."""
    fmt = known.get(dataset_path.lower())
    if fmt:
        return fmt
    cols = set(columns)
    return next((name for name, needed in formats.items() if needed <= cols), None)


def detect_format(dataset_path: str, columns: list[str] | set[str]) -> str:
    """Which benchmark mapping applies: by known hub path, else by the record's columns."""
    fmt = schema_of(dataset_path, columns, KNOWN_PATHS, FORMAT_COLUMNS)
    if fmt:
        return fmt
    cols = set(columns)
    raise SpecPrefetchError(
        f"hub dataset {dataset_path!r}: columns {sorted(cols)} match no supported benchmark "
        f"(GSM8K question/answer, HumanEval prompt/canonical_solution, OCRBench question/answer/image, "
        f"ChartQA query/label/image, HallusionBench question/gt_answer)")


def strip_image_placeholders(text: str) -> str:
    """Drop harness image tokens such as lm-eval chartqa's leading ``<image>``; the model inserts its own."""
    return IMAGE_PLACEHOLDERS.sub("", text)


def to_rgb_image(value: Any, where: str) -> Any:
    """A hub image cell (PIL image, {"bytes", "path"} dict, or raw bytes) as an RGB PIL image; None stays None."""
    from PIL import Image, UnidentifiedImageError

    if value is None:
        return None
    try:
        if isinstance(value, Image.Image):
            return value.convert("RGB")
        if isinstance(value, dict):
            if value.get("bytes"):
                return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
            if value.get("path"):
                return Image.open(value["path"]).convert("RGB")
            return None
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise SpecPrefetchError(f"{where}: image cannot be decoded: {exc}") from None
    raise SpecPrefetchError(f"{where}: unsupported image value of type {type(value).__name__}")


def _first(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        if not value:
            return ""
        value = value[0]
    return str(value)


# ------------------------------------------------------------------------------------------ mappings
def map_gsm8k(rec: dict[str, Any], fmt: Formatter | None = None) -> Draft:
    """GSM8K: prompt = lm-eval's ``Question: ...\\nAnswer:``; reference = the worked solution with ####."""
    answer = rec["answer"]
    final = answer.split("####")[-1].strip().replace(",", "") if "####" in answer else ""
    prompt = fmt(rec) if fmt else f"Question: {rec['question']}\nAnswer:"
    return Draft(prompt=prompt, reference=answer, meta={"answer": final, "question": rec["question"]})


def map_humaneval(rec: dict[str, Any], fmt: Formatter | None = None) -> Draft:
    prompt = fmt(rec) if fmt else rec["prompt"]
    return Draft(prompt=prompt, reference=rec["canonical_solution"],
                 meta={"task_id": rec.get("task_id", ""), "entry_point": rec["entry_point"], "test": rec["test"]})


def map_ocrbench(rec: dict[str, Any], fmt: Formatter | None = None) -> Draft:
    answers = rec["answer"] if isinstance(rec["answer"], (list, tuple)) else [rec["answer"]]
    answers = [str(a) for a in answers]
    prompt = fmt(rec) if fmt else str(rec["question"]).strip()  # lmms-eval's ocrbench_doc_to_text strips it
    meta = {"answer": answers[0] if answers else "", "answers": answers,
            "question_type": str(rec.get("question_type", "")), "dataset": str(rec.get("dataset", ""))}
    return Draft(prompt=strip_image_placeholders(prompt), reference=answers[0] if answers else "", meta=meta,
                 image=to_rgb_image(rec.get("image"), "OCRBench record"))


def map_chartqa(rec: dict[str, Any], fmt: Formatter | None = None) -> Draft:
    label = _first(rec["label"])
    prompt = fmt(rec) if fmt else rec["query"]
    meta = {"answer": label, "question": rec["query"], "human_or_machine": rec.get("human_or_machine")}
    return Draft(prompt=strip_image_placeholders(prompt), reference=label, meta=meta,
                 image=to_rgb_image(rec.get("image"), "ChartQA record"))


def map_hallusionbench(rec: dict[str, Any], fmt: Formatter | None = None) -> Draft:
    """HallusionBench: gt_answer "1"/"0" -> "Yes"/"No" (the benchmark's yes/no ground truth)."""
    gt = str(rec["gt_answer"]).strip()
    if gt not in ("0", "1"):
        raise SpecPrefetchError(f"HallusionBench record {rec.get('question_id', '?')}: "
                                f"gt_answer must be '0' or '1', got {gt!r}")
    answer = "Yes" if gt == "1" else "No"
    prompt = fmt(rec) if fmt else rec["question"]
    meta = {"answer": answer, "question": rec["question"], "category": str(rec.get("category", "")),
            "subcategory": str(rec.get("subcategory", "")), "gt_answer_details": str(rec.get("gt_answer_details", "")),
            "question_id": str(rec.get("question_id", ""))}
    return Draft(prompt=strip_image_placeholders(prompt), reference=answer, meta=meta,
                 image=to_rgb_image(rec.get("image"), "HallusionBench record"))


MAPPERS: dict[str, Callable[[dict[str, Any], Formatter | None], Draft]] = {
    "gsm8k": map_gsm8k, "humaneval": map_humaneval, "ocrbench": map_ocrbench, "chartqa": map_chartqa,
    "hallusionbench": map_hallusionbench,
}


# ------------------------------------------------------------------------------------------ loading
def offline_help(name: str) -> str:
    return (
        "To use a local copy instead: (1) on a machine with network, load the dataset once with "
        "datasets.load_dataset(...) into the same HF_HOME and then run with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "
        "so the cached copy is read (offline, datasets reads only the processed cache that load_dataset writes, "
        "HF_HOME/datasets/<org>___<name>/; `hf download` fills only HF_HOME/hub, which it does not read offline); "
        f"or (2) `hf download --repo-type dataset <path> --local-dir DIR` and set `workloads.{name}.dataset.path: "
        "DIR` (lm_eval_task still loads the hub id: drop it, or keep the cache of (1)); or (3) set "
        f"`workloads.{name}.generator: local` with `path:` a JSONL in the specprefetch workload format "
        "(keys id, benchmark, prompt, reference, image, split, source, meta; images relative to the JSONL).")


def load_hub_dataset(name: str, spec: dict[str, Any]) -> Any:
    """``datasets.load_dataset`` for workload ``name``; any failure becomes a SpecPrefetchError with the fix."""
    import datasets

    path, subset, split, revision = spec["path"], spec.get("name"), spec["split"], spec.get("revision")
    desc = f"{path!r} (name={subset!r}, split={split!r}, revision={revision!r})"
    log.info("loading hub dataset %s for workload %s", desc, name)
    try:
        return datasets.load_dataset(path, subset, split=split, revision=revision)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise SpecPrefetchError(
            f"workload {name!r}: cannot load hub dataset {desc}: {type(exc).__name__}: {exc}. "
            f"The Hugging Face hub may be unreachable. {offline_help(name)}") from None


@functools.lru_cache(maxsize=1)
def _task_manager() -> Any:
    """lm-eval's task index, built once per process (indexing its registry takes ~10 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def lm_eval_formatter(task_name: str, workload: str) -> Formatter:
    """The harness task's own ``doc_to_text`` (lm-eval builds the task, loading its dataset through the cache)."""
    try:
        tm = _task_manager()
    except ImportError as exc:
        raise SpecPrefetchError(f"workload {workload!r}: lm_eval_task needs lm-eval ({exc})") from None
    if task_name not in tm.all_subtasks:
        raise SpecPrefetchError(f"invalid config key 'workloads.{workload}.lm_eval_task': lm-eval has no task "
                                f"{task_name!r}")
    from specprefetch.data.lm_eval_tasks import allow_code_eval

    allow_code_eval()  # building humaneval builds its code_eval metric
    try:
        task = tm.load([task_name])["tasks"][task_name]
    except Exception as exc:  # noqa: BLE001 - lm-eval downloads the task's dataset; failures vary
        raise SpecPrefetchError(
            f"workload {workload!r}: lm-eval could not build task {task_name!r}: {type(exc).__name__}: {exc}. "
            "lm-eval also builds the task's metrics: humaneval's imports `evaluate.load('code_eval')` (a hub "
            "module, cached under HF_HOME/modules), refused when HF_ALLOW_CODE_EVAL is 0. "
            f"{offline_help(workload)} (or drop lm_eval_task to use the raw question as prompt)") from None

    def fmt(doc: dict[str, Any]) -> str:
        text = task.doc_to_text(doc)
        if not isinstance(text, str):
            raise SpecPrefetchError(f"lm-eval task {task_name!r}: doc_to_text returned {type(text).__name__}")
        return strip_image_placeholders(text)

    return fmt


def class_label_columns(ds: Any) -> dict[str, Any]:
    """Columns stored as ``ClassLabel`` (ChartQA's ``human_or_machine``): records hold their integer index."""
    from datasets import ClassLabel

    return {c: f for c, f in (getattr(ds, "features", None) or {}).items() if isinstance(f, ClassLabel)}


def name_class_labels(draft: Draft, labels: dict[str, Any]) -> Draft:
    """Meta values copied from ``ClassLabel`` columns as their names (0 -> "human"; -1, no label, -> None)."""
    for col, feature in labels.items():
        v = draft.meta.get(col)
        if isinstance(v, int) and not isinstance(v, bool):
            draft.meta[col] = feature.int2str(v) if v >= 0 else None
    return draft


def hub_drafts(name: str, w: dict[str, Any], seed: int) -> tuple[list[Draft], str]:
    """All records (or a seeded n_samples subset) of workload ``name``'s hub dataset, mapped to drafts."""
    from tqdm import tqdm

    spec = w["dataset"]
    ds = load_hub_dataset(name, spec)
    fmt_name = detect_format(spec["path"], list(ds.column_names))
    fmt = lm_eval_formatter(w["lm_eval_task"], name) if w.get("lm_eval_task") else None
    order = seeded_order(len(ds), w.get("n_samples"), seed) if w.get("n_samples") else list(range(len(ds)))
    mapper = MAPPERS[fmt_name]
    labels = class_label_columns(ds)
    drafts = []
    for i in tqdm(order, desc=name, disable=None, leave=False):
        try:
            drafts.append(name_class_labels(mapper(ds[i], fmt), labels))
        except KeyError as exc:
            raise SpecPrefetchError(f"workload {name!r}: record {i} of {spec['path']!r} lacks column {exc}") from None
    fingerprint = getattr(ds, "_fingerprint", "unknown")
    source = (f"hub {spec['path']} name={spec.get('name')} split={spec['split']} revision={spec.get('revision')} "
              f"fingerprint={fingerprint}")
    return drafts, source
