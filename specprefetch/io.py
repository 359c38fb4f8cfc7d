"""Atomic outputs and provenance.

Every stage writes to a temporary sibling path and renames it into place, so an interrupted or
failed job never leaves an output that Snakemake (or a reader) would take as complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

MESSAGE_MAX_CHARS = 2000  # an error is one readable line: a hostile value it quotes cannot make it megabytes


def bounded_message(message: str, limit: int = MESSAGE_MAX_CHARS) -> str:
    """``message`` with its middle elided past ``limit`` characters (the start names the file, the end the fix)."""
    if len(message) <= limit:
        return message
    head, tail = (limit * 3) // 5, limit // 5
    return f"{message[:head]} ...[{len(message) - head - tail} characters omitted]... {message[-tail:]}"


class SpecPrefetchError(RuntimeError):
    """An error caused by bad input (config, files, checkpoints, traces, logs); the message names it (bounded)."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (bounded_message(args[0]),)
        super().__init__(*args)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; rename it onto ``target`` only if the block succeeds.

    For directories the temporary directory is created empty; for files nothing is created. Temporaries of the same
    target left by a killed writer (SIGKILL leaves no chance to clean up) are removed first: one job owns a target.
    On any exception the temporary path is removed and ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    mine = re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.tmp")  # tempfile.mkdtemp's names
    for stale in target.parent.glob(f".{glob_escape(target.name)}.*.tmp"):  # left by a killed job (SIGKILL)
        if mine.fullmatch(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    work = tmp if is_dir else tmp / target.name
    try:
        yield work
        if is_dir:
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        else:
            os.replace(work, target)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_paths(targets: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """Files that appear together or not at all (a table's .tex and .json): yield a temporary path per target
    (in one temporary directory beside the first); after the block all are renamed into place. If the block or a
    rename fails (a full disk), the temporaries and every target this group already renamed are removed again."""
    paths = [Path(t) for t in targets]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{paths[0].name}.", suffix=".tmp", dir=paths[0].parent))
    works = [tmp / f"{i}-{p.name}" for i, p in enumerate(paths)]
    done: list[Path] = []
    try:
        yield works
        for work, target in zip(works, paths):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(work, target)
            done.append(target)
    except BaseException:
        for target in done:
            target.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def write_json_atomic(target: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(target, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-serialisable config fragment (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_identity() -> dict[str, str]:
    """The CPU a result was computed on: its model name and the vector instruction set torch's kernels use (results
    that pass through training are reproducible bit for bit on one CPU, not across CPUs: docs/tables.md)."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"model": model or "unknown"}
    try:
        import torch

        out["torch_capability"] = str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        pass
    return out


def provenance(config_fragment: Any = None, seed: int | None = None, **extra: Any) -> dict[str, Any]:
    """What produced a result: code version, library versions, config hash, seed, host and time."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "tokenizers", "safetensors", "snakemake", "numpy", "pandas"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    from specprefetch import __version__

    prov: dict[str, Any] = {
        "specprefetch": __version__,
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_identity(),
        "versions": versions,
        "created_unix": round(time.time(), 3),
    }
    if config_fragment is not None:
        prov["config_hash"] = config_hash(config_fragment)
    if seed is not None:
        prov["seed"] = seed
    prov.update(extra)
    return prov


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch, and make torch deterministic (CPU MoE training is not otherwise)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
    except ImportError:
        pass
