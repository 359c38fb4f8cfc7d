"""Workload directories: the ``Sample`` record, a validating reader, an atomic writer, and ``prepare_workload``.

A workload directory (see the shared data contract) holds ``samples.jsonl`` (one sample per line),
``images/*.png`` (RGB PNGs) and ``manifest.json`` (written last inside an atomic directory, with the sha256 of
``samples.jsonl``). Every later stage reads workloads through :func:`read_workload`, so a malformed line or a
missing image is reported once, here, with the file and line number.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm import tqdm

from specprefetch.contracts import WORKLOAD_FORMAT, check_pixel_budget, path_problem, read_doc, read_jsonl, reraise_as
from specprefetch.data.draft import Draft, seeded_order
from specprefetch.io import SpecPrefetchError, atomic_path, provenance, sha256_file

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"
IMAGES_DIR = "images"
SAMPLE_KEYS = ("id", "benchmark", "prompt", "reference", "image", "split", "source", "meta")
REQUIRED_KEYS = ("id", "benchmark", "prompt", "reference", "image", "split", "source")
SPLITS = ("test", "train")
SYNTH_GENERATORS = ("gsm8k_synth", "ocr_synth", "chartqa_synth", "hallusion_synth")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class WorkloadError(SpecPrefetchError):
    """A workload file or directory is malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Sample:
    """One evaluation (or corpus) sample, exactly one line of ``samples.jsonl``."""

    id: str
    benchmark: str
    prompt: str
    reference: str
    image: str | None
    split: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    def image_path(self, root: Path) -> Path | None:
        """Absolute path of the sample's image inside workload dir ``root`` (None for text-only samples)."""
        return None if self.image is None else Path(root) / self.image

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SAMPLE_KEYS}

    def to_line(self) -> str:
        """The sample as one JSON line; key order is fixed so equal samples give equal bytes."""
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(", ", ": "))

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Sample:
        """Validate a parsed JSON line; ``where`` ("file:line") prefixes every error."""
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in obj]
        if missing:
            raise WorkloadError(f"{where}: missing key(s) {', '.join(missing)}")
        unknown = sorted(set(obj) - set(SAMPLE_KEYS))
        if unknown:
            raise WorkloadError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(SAMPLE_KEYS)})")
        for key in ("id", "benchmark", "prompt", "reference", "split", "source"):
            if not isinstance(obj[key], str):
                raise WorkloadError(f"{where}: key {key!r} must be a string, got {type(obj[key]).__name__}")
        if not obj["id"].strip():
            raise WorkloadError(f"{where}: key 'id' is empty")
        if not obj["prompt"].strip():
            raise WorkloadError(f"{where}: key 'prompt' is empty (sample {obj['id']!r})")
        if obj["split"] not in SPLITS:
            raise WorkloadError(f"{where}: key 'split' must be one of {SPLITS}, got {obj['split']!r}")
        image = obj["image"]
        if image is not None:
            if not isinstance(image, str):
                raise WorkloadError(f"{where}: key 'image' must be a relative path string or null")
            _check_relative(image, where)
        meta = obj.get("meta", {})
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise WorkloadError(f"{where}: key 'meta' must be an object, got {type(meta).__name__}")
        return cls(id=obj["id"], benchmark=obj["benchmark"], prompt=obj["prompt"], reference=obj["reference"],
                   image=image, split=obj["split"], source=obj["source"], meta=meta)


def _check_relative(image: str, where: str) -> None:
    p = PurePosixPath(image)
    if p.is_absolute() or ".." in p.parts or "\\" in image or not image:
        raise WorkloadError(f"{where}: key 'image' must be a path relative to the workload dir, got {image!r}")
    if p.suffix.lower() != ".png":
        raise WorkloadError(f"{where}: key 'image' must name a .png file, got {image!r}")


# ------------------------------------------------------------------------------------------ reading
def read_samples_jsonl(path: Path, image_root: Path | None = None) -> list[Sample]:
    """Parse and validate every line of a samples JSONL; a bad line raises naming ``path:line``.

    With ``image_root``, each referenced image must exist under it.
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"samples file not found: {path}")
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    with reraise_as(WorkloadError):
        for where, obj in read_jsonl(path, "samples file"):
            sample = Sample.from_json(obj, where)
            if sample.id in seen:
                raise WorkloadError(f"{where}: duplicate id {sample.id!r} (first on line {seen[sample.id]})")
            seen[sample.id] = int(where.rsplit(":", 1)[1])
            if image_root is not None and sample.image is not None:
                img = image_root / sample.image
                why = path_problem(img)  # stat only: a FIFO, loop or directory is named, nothing is opened
                if why is not None:
                    raise WorkloadError(f"{where}: image file {'not found' if why == 'not found' else why}: {img} "
                                        f"(sample {sample.id!r})")
            samples.append(sample)
    if not samples:
        raise WorkloadError(f"{path}: no samples")
    return samples


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise WorkloadError(f"{path}: missing; {root} is not a complete workload directory")
    with reraise_as(WorkloadError):
        return read_doc(path, WORKLOAD_FORMAT, "workload manifest")


def read_workload(root: Path, verify: bool = True) -> list[Sample]:
    """Read a workload (or corpus) directory, validating the manifest, every line and every image path.

    With ``verify`` the sha256 of ``samples.jsonl`` must match the manifest (catches edits and truncation).
    """
    root = Path(root)
    if not root.is_dir():
        raise WorkloadError(f"workload directory not found: {root}")
    manifest = read_manifest(root)
    path = root / SAMPLES_FILE
    if verify and path.is_file():
        digest = sha256_file(path)
        if digest != manifest.get("samples_sha256"):
            raise WorkloadError(
                f"{path}: sha256 {digest[:12]}... does not match manifest "
                f"({str(manifest.get('samples_sha256'))[:12]}...);"
                " the file was modified or truncated, re-run prepare-workload")
    samples = read_samples_jsonl(path, image_root=root)
    if manifest.get("n_samples") != len(samples):
        raise WorkloadError(f"{path}: {len(samples)} samples but manifest says {manifest.get('n_samples')}")
    return samples


# ------------------------------------------------------------------------------------------ writing
def write_workload(out_dir: Path, samples: Sequence[Sample], images: Mapping[str, bytes | Path], generator: str,
                   seed: int | None, provenance: dict[str, Any], lm_eval_task: str | None = None,
                   name: str | None = None) -> Path:
    """Write a workload directory atomically: images, samples.jsonl, optional lm-eval task, manifest last.

    ``images`` maps each sample's relative image path to its PNG bytes (or a file holding them); both sides must
    match exactly.
    """
    out_dir = Path(out_dir)
    name = name or out_dir.name
    _check_consistent(samples, images, out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        for rel, data in sorted(images.items()):
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, Path):  # PNG bytes spilled to a file (a large corpus never holds them all)
                shutil.copyfile(data, dest)
            else:
                dest.write_bytes(data)
        with open(tmp / SAMPLES_FILE, "w", encoding="utf-8", newline="\n") as f:
            for s in samples:
                f.write(s.to_line() + "\n")
        task_yaml = None
        if lm_eval_task:
            from specprefetch.data.lm_eval_tasks import write_lm_eval_task

            task_yaml = write_lm_eval_task(tmp, lm_eval_task, data_dir=out_dir.resolve()).relative_to(tmp)
        manifest = {
            "format": WORKLOAD_FORMAT,
            "name": name,
            "n_samples": len(samples),
            "n_images": len(images),
            "samples_sha256": sha256_file(tmp / SAMPLES_FILE),
            "generator": generator,
            "seed": seed,
            "lm_eval_task": lm_eval_task,
            "lm_eval_yaml": None if task_yaml is None else task_yaml.as_posix(),
            "provenance": provenance,
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    log.info("wrote %s: %d samples, %d images", out_dir, len(samples), len(images))
    return out_dir


def _check_consistent(samples: Sequence[Sample], images: Mapping[str, bytes | Path], out_dir: Path) -> None:
    ids: set[str] = set()
    referenced: set[str] = set()
    for i, s in enumerate(samples):
        where = f"{out_dir}/{SAMPLES_FILE} (sample {i})"
        Sample.from_json(s.to_json(), where)
        if s.id in ids:
            raise WorkloadError(f"{where}: duplicate id {s.id!r}")
        ids.add(s.id)
        if s.image is not None:
            if s.image not in images:
                raise WorkloadError(f"{where}: image {s.image!r} has no bytes to write")
            referenced.add(s.image)
    extra = sorted(set(images) - referenced)
    if extra:
        raise WorkloadError(f"{out_dir}: images not referenced by any sample: {extra[:3]}")
    for rel, data in images.items():
        if isinstance(data, Path):
            with open(data, "rb") as f:
                data = f.read(len(PNG_SIGNATURE))
        if not data.startswith(PNG_SIGNATURE):
            raise WorkloadError(f"{out_dir}/{rel}: not PNG bytes")


def assemble(drafts: Sequence[Draft], prefix: str, benchmark: str, split: str,
             source: str | Callable[[int], str]) -> tuple[list[Sample], dict[str, bytes | Path]]:
    """Assign ids ("{prefix}-00007"), image paths ("images/00007.png") and sources to generated drafts."""
    from specprefetch.data.imaging import png_bytes

    samples: list[Sample] = []
    images: dict[str, bytes | Path] = {}
    for i, d in enumerate(drafts):
        rel = None
        if d.image is not None:
            rel = f"{IMAGES_DIR}/{i:05d}.png"
            images[rel] = d.image if isinstance(d.image, (bytes, Path)) else png_bytes(d.image)
        src = source(i) if callable(source) else source
        samples.append(Sample(id=f"{prefix}-{i:05d}", benchmark=benchmark, prompt=d.prompt, reference=d.reference,
                              image=rel, split=split, source=src, meta=dict(d.meta)))
    return samples, images


# ------------------------------------------------------------------------------------------ preparing
def generate_drafts(generator: str, seed: int, n: int, image_size: int, desc: str = "") -> list[Draft]:
    """Drafts 0..n-1 of a synthetic generator; sample i depends only on (generator, seed, i)."""
    from specprefetch.data.generators import GENERATORS

    fn = GENERATORS[generator]
    return [fn(seed, i, image_size) for i in tqdm(range(n), desc=desc or generator, disable=None, leave=False)]


def workload_config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    try:
        return cfg["workloads"][name]
    except KeyError:
        known = ", ".join(cfg.get("workloads", {})) or "none"
        raise SpecPrefetchError(f"unknown workload {name!r}: config key 'workloads.{name}' not found "
                                f"(configured: {known})") from None


def prepare_workload(cfg: dict[str, Any], name: str, out_dir: Path) -> None:
    """Build workload ``name`` of ``cfg`` into ``out_dir`` (atomic), dispatching on its ``generator``."""
    w = workload_config(cfg, name)
    generator = w["generator"]
    seed = int(w["seed"])
    size = int(cfg["image"]["size"])
    n = w.get("n_samples")
    lm_task = w.get("lm_eval_task")
    prov_extra: dict[str, Any] = {"workload": name, "generator": generator}
    log.info("preparing workload %s (generator %s, seed %d)", name, generator, seed)
    if generator in SYNTH_GENERATORS:
        drafts = generate_drafts(generator, seed, int(n), size, desc=name)
        samples, images = assemble(drafts, name, name, "test", f"{generator} seed={seed}")
    elif generator == "humaneval":
        from specprefetch.data.humaneval import humaneval_drafts

        drafts, source = humaneval_drafts(n, seed)
        samples, images = assemble(drafts, name, name, "test", source)
    elif generator == "hub":
        from specprefetch.data.hub import hub_drafts

        drafts, source = hub_drafts(name, w, seed)
        samples, images = assemble(drafts, name, name, "test", source)
        lm_task = None  # lm_eval_task names the upstream harness task here, which users run directly
        prov_extra["dataset"] = w["dataset"]
    elif generator == "local":
        samples, images = local_samples(name, w, seed)
        prov_extra["path"] = str(w["path"])
    else:
        raise SpecPrefetchError(f"invalid config key 'workloads.{name}.generator': unknown generator {generator!r}")
    prov = provenance({"workload": w, "image": cfg["image"]}, seed=seed, **prov_extra)
    write_workload(Path(out_dir), samples, images, generator, seed, prov, lm_eval_task=lm_task, name=name)


def resolve_user_path(value: str) -> Path:
    """A config path: absolute, else relative to the working directory, else to the repository root."""
    from specprefetch.config import REPO_ROOT

    p = Path(value)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


def local_samples(name: str, w: dict[str, Any], seed: int) -> tuple[list[Sample], dict[str, bytes]]:
    """A user JSONL in the workload format: validated, images re-encoded as RGB PNGs under images/."""
    from PIL import Image, UnidentifiedImageError

    from specprefetch.data.imaging import png_bytes

    if not w.get("path"):
        raise SpecPrefetchError(f"invalid config key 'workloads.{name}.path': required for generator 'local'")
    path = resolve_user_path(w["path"])
    root = path.parent
    user = read_samples_jsonl(path, image_root=root)
    order = seeded_order(len(user), w.get("n_samples"), seed) if w.get("n_samples") else list(range(len(user)))
    samples: list[Sample] = []
    images: dict[str, bytes] = {}
    for i, k in enumerate(order):
        s = user[k]
        rel = None
        if s.image is not None:
            src = root / s.image
            where = f"{path}: image {src} of sample {s.id!r}"
            why = path_problem(src)  # before open: a FIFO would block, a directory or loop is no image
            if why is not None:
                raise WorkloadError(f"{where}: {why}")
            try:
                with Image.open(src) as im:
                    with reraise_as(WorkloadError):
                        check_pixel_budget(im.size, where)  # from the header, before any pixel is decoded
                    data = png_bytes(im.convert("RGB"))
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
                raise WorkloadError(f"{path}: image {src} of sample {s.id!r} cannot be read: {exc}") from None
            rel = f"{IMAGES_DIR}/{i:05d}.png"
            images[rel] = data
        samples.append(Sample(id=s.id, benchmark=name, prompt=s.prompt, reference=s.reference, image=rel,
                              split=s.split, source=s.source or f"local {path}", meta=s.meta))
    return samples, images


def iter_image_hashes(root: Path, samples: Sequence[Sample]) -> dict[str, str]:
    """sha256 of each sample's image bytes, keyed by sample id."""
    out = {}
    for s in samples:
        p = s.image_path(root)
        if p is not None:
            out[s.id] = sha256_file(p)
    return out


__all__ = [
    "Draft", "WORKLOAD_FORMAT", "Sample", "WorkloadError", "assemble", "iter_image_hashes", "prepare_workload",
    "read_manifest", "read_samples_jsonl", "read_workload", "seeded_order", "write_workload",
]
