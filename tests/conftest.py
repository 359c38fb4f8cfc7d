"""Shared fixtures: a tiny tokenizer with the contract's special tokens and a tiny corpus in workload format.

Both are built from scratch here (no dependency on the data package's generators), so any test file can use
them: ``tiny_tokenizer_dir`` (a ``save_pretrained`` directory), ``tiny_corpus_dir`` (``samples.jsonl`` +
``images/*.png`` + ``manifest.json`` with the workload format), ``smoke_cfg`` (the validated smoke profile),
``hub_mirror`` (a Hugging Face cache holding the paper's benchmarks and a tiny Qwen3-VL-MoE under their hub ids;
see tests/hub_mirror.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<image>"]
_WORDS = ("the quick brown fox jumps over a lazy dog while seven red birds count numbers in the chart "
          "def return value total answer is what how many sum of label shows image text").split()


def tiny_texts(n: int, seed: int) -> list[tuple[str, str]]:
    """Deterministic (prompt, reference) pairs with learnable structure (the answer repeats prompt words)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 9))]
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append((f"Question: {' '.join(words)}. What is {a} plus {b}?", f"{' '.join(words[:3])} {a + b}."))
    return out


def build_tokenizer(out_dir: Path, vocab_size: int = 320, texts: list[str] | None = None) -> Path:
    """Byte-level BPE trained with ``tokenizers``, saved as a PreTrainedTokenizerFast (contract specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = texts or [p + " " + r for p, r in tiny_texts(200, 0)]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", additional_special_tokens=SPECIAL_TOKENS[2:])
    fast.save_pretrained(out_dir)
    return out_dir


def write_tiny_workload(root: Path, n: int, image_size: int, seed: int = 0, split: str = "train",
                        benchmark: str = "corpus") -> Path:
    """A workload directory in the contract's format; every other sample has a size x size RGB PNG."""
    import numpy as np
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i, (prompt, ref) in enumerate(tiny_texts(n, seed)):
        image = None
        if i % 2 == 0:
            image = f"images/{i:05d}.png"
            Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)).save(root / image)
        lines.append(json.dumps({"id": f"{benchmark}-{i:05d}", "benchmark": benchmark, "prompt": prompt,
                                 "reference": ref, "image": image, "split": split,
                                 "source": f"tests.conftest seed={seed}", "meta": {}}))
    data = ("\n".join(lines) + "\n").encode()
    (root / "samples.jsonl").write_bytes(data)
    manifest = {"format": "specprefetch-workload/1", "name": root.name, "n_samples": n,
                "n_images": sum(1 for i in range(n) if i % 2 == 0),
                "samples_sha256": hashlib.sha256(data).hexdigest(), "generator": "tests", "seed": seed,
                "provenance": {}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return root


@pytest.fixture(scope="session")
def smoke_cfg() -> dict[str, Any]:
    from specprefetch.config import load_config

    return load_config(REPO / "config" / "smoke.yaml")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory: pytest.TempPathFactory, smoke_cfg: dict[str, Any]) -> Path:
    return write_tiny_workload(tmp_path_factory.mktemp("corpus") / "corpus", 24, smoke_cfg["image"]["size"], seed=1)


@pytest.fixture(scope="session")
def hub_mirror(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A local hub mirror (``HF_HOME`` layout), written at test time by a fresh interpreter: ``env`` (the
    variables that point a process at it, offline), ``config_overrides`` / ``override_file`` (the paper
    profile's ``models.*`` keys of the tiny checkpoints), ``hf_home``, ``benchmarks``, ``models``."""
    from hub_mirror import write_hub_mirror_isolated

    return write_hub_mirror_isolated(tmp_path_factory.mktemp("hf_home"))


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """Tiny models: one intra-op thread is ~10x faster than two on a shared, oversubscribed CPU
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module that builds them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg() -> dict:
    """The embedded default's resolved config (the render tests' fixture; a module may define its own)."""
    from specprefetch.config import REPO_ROOT, load_config

    return load_config(REPO_ROOT / "config" / "config.yaml")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, cfg: dict) -> dict:
    """Every result CSV the tables and figures read, written from the render tests' fixture frames."""
    from test_render import write_fixture_results

    return write_fixture_results(tmp_path_factory.mktemp("results"), cfg)
