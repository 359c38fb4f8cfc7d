"""The predictors' training corpus (also the stand-ins' pretraining text) and the disjointness check.

The paper trains predictors on "a heterogeneous multimodal instruction corpus" and evaluates on disjoint
benchmarks. Here the corpus mixes the synthetic generators (with seeds derived from the corpus seed, never a
workload's) and Python-stdlib code and prose, in the proportions of ``train_corpus.mixture``, and/or real instruction
datasets from the hub (``train_corpus.hub``, :mod:`specprefetch.data.hub_corpus`), all weights taken together.
:func:`check_disjoint` proves by hashing that no corpus sample's text or image appears in an evaluation workload.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import tempfile
from collections.abc import Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specprefetch.data.generators import GENERATORS
from specprefetch.data.hub_corpus import hub_corpus_drafts, hub_keys
from specprefetch.data.workloads import Draft, Sample, assemble, read_workload, write_workload
from specprefetch.io import SpecPrefetchError, provenance, sha256_file

log = logging.getLogger(__name__)

CORPUS = "corpus"
STDLIB_SOURCES = ("stdlib_code", "stdlib_docs")


class DisjointnessError(SpecPrefetchError):
    """A corpus sample also appears in an evaluation workload."""


def mixture_counts(mixture: dict[str, float], n: int) -> dict[str, int]:
    """Split n samples by the mixture weights (largest remainder; ties broken by name), summing to n."""
    total = sum(mixture.values())
    if total <= 0:
        raise SpecPrefetchError("invalid config key 'train_corpus.mixture': weights must sum to > 0")
    exact = {k: n * w / total for k, w in mixture.items()}
    counts = {k: int(v) for k, v in exact.items()}
    by_remainder = sorted(mixture, key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def derived_seed(corpus_seed: int, source: str, avoid: set[int]) -> int:
    """A seed for ``source`` derived from the corpus seed, never one of ``avoid`` (the workloads' seeds)."""
    digest = hashlib.sha256(f"specprefetch-corpus/{corpus_seed}/{source}".encode()).digest()
    seed = int.from_bytes(digest[:4], "big")
    while seed in avoid:
        seed += 1
    return seed


def _workload_seeds(cfg: dict[str, Any], generator: str) -> set[int]:
    return {int(w["seed"]) for w in cfg["workloads"].values() if w["generator"] == generator}


def _workload_text_keys(cfg: dict[str, Any]) -> set[str]:
    """Prompts of the configured text-only synthetic workloads, to skip any (unlikely) collision up front."""
    keys: set[str] = set()
    for w in cfg["workloads"].values():
        if w["generator"] == "gsm8k_synth":
            gen = GENERATORS["gsm8k_synth"]
            keys.update(_hash_text(gen(int(w["seed"]), i, 0).prompt) for i in range(int(w["n_samples"])))
    return keys


def _hash_text(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def synth_drafts(generator: str, seed: int, n: int, size: int, avoid_prompts: set[str]) -> list[tuple[Draft, str]]:
    """n drafts of a generator; text-only drafts whose prompt is an evaluation prompt are skipped."""
    fn = GENERATORS[generator]
    out: list[tuple[Draft, str]] = []
    index = 0
    with tqdm(total=n, desc=f"corpus {generator}", disable=None, leave=False) as bar:
        while len(out) < n:
            d = fn(seed, index, size)
            if d.image is not None or _hash_text(d.prompt) not in avoid_prompts:
                out.append((d, f"{generator} seed={seed} index={index}"))
                bar.update(1)
            index += 1
    return out


def prepare_train_corpus(cfg: dict[str, Any], out_dir: Path) -> None:
    """Build the corpus of ``cfg["train_corpus"]`` into ``out_dir`` (atomic), split "train", benchmark "corpus"."""
    from specprefetch.data.stdlib import stdlib_drafts

    tc = cfg["train_corpus"]
    seed, n = int(tc["seed"]), int(tc["n_samples"])
    size = int(cfg["image"]["size"])
    mixture, hub = dict(tc.get("mixture") or {}), list(tc.get("hub") or [])
    keys = hub_keys(hub)
    counts = mixture_counts({**mixture, **{k: float(e["weight"]) for k, e in zip(keys, hub)}}, n)
    log.info("corpus: %d samples, mixture %s", n, counts)
    parts: dict[str, list[tuple[Draft, str]]] = {}
    for source in STDLIB_SOURCES:
        if counts.get(source):
            s_seed = derived_seed(seed, source, set())
            drafts = stdlib_drafts(source, counts[source], s_seed)
            parts[source] = [(d, d.meta.get("source", source)) for d in drafts]
            if len(drafts) < counts[source]:
                log.warning("corpus: the stdlib has only %d %s items (wanted %d); the synthetic sources make up "
                            "the difference", len(drafts), source, counts[source])
    shortfall = sum(counts[s] - len(parts[s]) for s in parts)
    synth = {k: v for k, v in mixture.items() if k in GENERATORS}
    if shortfall and not synth:
        raise SpecPrefetchError(f"train_corpus: the stdlib sources yield {n - shortfall} of {n} samples and the "
                                "mixture has no synthetic source to make up the difference")
    extra = mixture_counts(synth, shortfall) if shortfall else {}
    avoid = _workload_text_keys(cfg)
    for gen in sorted(synth):
        want = counts[gen] + extra.get(gen, 0)
        if want:
            g_seed = derived_seed(seed, gen, _workload_seeds(cfg, gen))
            parts[gen] = synth_drafts(gen, g_seed, want, size, avoid)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out_dir.name}.images-"  # one job owns out_dir: a spill left by a killed run (SIGKILL) is removed
    for stale in out_dir.parent.glob(f"{glob_escape(prefix)}*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=out_dir.parent) as spill:
        _write_corpus(cfg, out_dir, parts, hub, keys, counts, Path(spill))


def _write_corpus(cfg: dict[str, Any], out_dir: Path, parts: dict[str, list[tuple[Draft, str]]],
                  hub: list[dict[str, Any]], keys: list[str], counts: dict[str, int], spill: Path) -> None:
    """Add the hub datasets' drafts (their images spilled to files under ``spill``), shuffle, write."""
    tc = cfg["train_corpus"]
    seed = int(tc["seed"])
    hub_prov: list[dict[str, Any]] = []
    if hub:  # real instruction datasets; check_disjoint proves them disjoint from the workloads like the rest
        hub_parts, hub_prov = hub_corpus_drafts(hub, counts, {k: derived_seed(seed, k, set()) for k in keys}, spill)
        parts.update(hub_parts)
    ordered = [item for source in sorted(parts) for item in parts[source]]
    random.Random(f"specprefetch/corpus-order/{seed}").shuffle(ordered)
    drafts = [Draft(prompt=d.prompt, reference=d.reference, image=d.image,
                    meta={k: v for k, v in d.meta.items() if k != "source"}) for d, _ in ordered]
    samples, images = assemble(drafts, CORPUS, CORPUS, "train", lambda i: ordered[i][1])
    realised = {source: len(items) for source, items in sorted(parts.items())}
    prov = provenance({"train_corpus": tc, "image": cfg["image"]}, seed=seed, mixture_counts=realised,
                      **({"hub": hub_prov} if hub else {}))
    write_workload(out_dir, samples, images, "corpus", seed, prov, name=CORPUS)


# ------------------------------------------------------------------------------------------ disjointness
def sample_keys(root: Path, samples: Sequence[Sample]) -> dict[str, dict[str, str]]:
    """Per sample id: text (prompt+reference), prompt, image and full (text+image) sha256 keys."""
    out: dict[str, dict[str, str]] = {}
    for s in samples:
        p = s.image_path(root)
        image = sha256_file(p) if p is not None else ""
        text = _hash_text(s.prompt, s.reference)
        out[s.id] = {"text": text, "prompt": _hash_text(s.prompt), "image": image,
                     "full": _hash_text(text, image)}
    return out


def check_disjoint(corpus_dir: Path, workload_dirs: Sequence[Path]) -> dict[str, Any]:
    """Raise DisjointnessError if any corpus sample overlaps an evaluation sample; return a report otherwise.

    Overlap means: the same (prompt, reference, image bytes); or the same image bytes at all; or, for text-only
    samples on both sides, the same prompt (a seen question leaks its answer even if worded references differ).
    """
    corpus_dir = Path(corpus_dir)
    corpus = read_workload(corpus_dir)
    ckeys = sample_keys(corpus_dir, corpus)
    index: dict[tuple[str, str], list[str]] = {}
    for s in corpus:
        k = ckeys[s.id]
        index.setdefault(("full", k["full"]), []).append(s.id)
        if k["image"]:
            index.setdefault(("image", k["image"]), []).append(s.id)
        else:
            index.setdefault(("prompt", k["prompt"]), []).append(s.id)
    overlaps: list[str] = []
    report: dict[str, Any] = {"corpus": {"dir": str(corpus_dir), "n_samples": len(corpus),
                                         "samples_sha256": sha256_file(corpus_dir / "samples.jsonl")},
                              "workloads": {}}
    for wdir in workload_dirs:
        wdir = Path(wdir)
        samples = read_workload(wdir)
        wkeys = sample_keys(wdir, samples)
        n_img = 0
        for s in samples:
            k = wkeys[s.id]
            probes = [("full", k["full"])]
            if k["image"]:
                probes.append(("image", k["image"]))
                n_img += 1
            else:
                probes.append(("prompt", k["prompt"]))
            for kind, h in probes:
                for cid in index.get((kind, h), []):
                    overlaps.append(f"{kind}: corpus sample {cid} = {wdir.name}/{s.id}")
        report["workloads"][wdir.name] = {"dir": str(wdir), "n_samples": len(samples), "n_images": n_img,
                                          "samples_sha256": sha256_file(wdir / "samples.jsonl")}
    if overlaps:
        shown = "; ".join(sorted(set(overlaps))[:8])
        raise DisjointnessError(f"{len(set(overlaps))} overlap(s) between corpus {corpus_dir} and the workloads: "
                                f"{shown}")
    report["overlaps"] = 0
    report["checks"] = ["same prompt+reference+image", "same image bytes", "same prompt (text-only samples)"]
    log.info("disjoint: %d corpus samples vs %d workload samples, no overlap", len(corpus),
             sum(w["n_samples"] for w in report["workloads"].values()))
    return report
