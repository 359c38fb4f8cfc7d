"""Local lm-evaluation-harness tasks for generated workloads, so ``lm_eval --include_path`` runs them as-is.

The task reads the workload's own ``samples.jsonl`` through the ``json`` dataset builder (no network), shows
``prompt`` verbatim and scores against ``reference``; the prompts a harness user sees are therefore exactly the
prompts whose routing traces the pipeline records.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from specprefetch.io import SpecPrefetchError

TASK_DIR = "lm_eval"
log = logging.getLogger(__name__)


def allow_code_eval() -> None:
    """Let lm-eval's code-execution tasks build and score: HumanEval's ``code_eval`` metric (a hub module) refuses
    unless ``HF_ALLOW_CODE_EVAL=1``. The profile names the task (``lm_eval_task: humaneval``), so running the
    generated programs is what was asked for; set ``HF_ALLOW_CODE_EVAL=0`` to refuse instead."""
    if "HF_ALLOW_CODE_EVAL" not in os.environ:
        log.info("HF_ALLOW_CODE_EVAL=1 for this process: lm-eval's code-execution tasks run the generated programs")
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"


def task_config(task_name: str, samples_file: Path, workload: str) -> dict[str, Any]:
    """The lm-eval task config (a plain dict, dumped as YAML) for one workload's samples file."""
    return {
        "task": task_name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(samples_file)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{reference}}",
        "generation_kwargs": {"until": ["<|endoftext|>", "<|im_end|>"], "do_sample": False, "max_gen_toks": 256},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": False}],
        "metadata": {"version": 1.0, "workload": workload, "generated_by": "specprefetch"},
    }


def write_lm_eval_task(workload_dir: Path, task_name: str, data_dir: Path | None = None) -> Path:
    """Write ``<workload_dir>/lm_eval/<task_name>.yaml`` and return its path.

    ``data_dir`` is where ``samples.jsonl`` will live when the task runs (the final workload directory when
    ``workload_dir`` is still the temporary one of an atomic write); the YAML stores that absolute path.
    """
    if not task_name or not task_name.replace("_", "").replace("-", "").isalnum():
        raise SpecPrefetchError(f"invalid lm-eval task name {task_name!r}: use letters, digits, '_' and '-'")
    workload_dir = Path(workload_dir)
    data_dir = Path(data_dir or workload_dir).resolve()
    out = workload_dir / TASK_DIR / f"{task_name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = task_config(task_name, data_dir / "samples.jsonl", data_dir.name)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return out


def load_lm_eval_task(workload_dir: Path, task_name: str) -> Any:
    """Build the lm-eval Task from a workload's task YAML (offline: the json builder reads the local file)."""
    from lm_eval.tasks import TaskManager

    include = Path(workload_dir) / TASK_DIR
    if not (include / f"{task_name}.yaml").is_file():
        raise SpecPrefetchError(f"lm-eval task file not found: {include / (task_name + '.yaml')}")
    tm = TaskManager(include_path=str(include), include_defaults=False)
    return tm.load([task_name])["tasks"][task_name]
