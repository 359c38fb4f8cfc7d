"""The stand-ins' tokenizer: byte-level BPE trained with ``tokenizers`` on the training corpus only.

Byte-level BPE round-trips any text exactly (code, unicode prose), and the special tokens of the shared
contract (chat, vision and DeepSeek-style ``<image>`` markers) are single tokens. Training sees only the
corpus's prompt and reference text, never the evaluation workloads. The BPE trainer is deterministic for a
given input order, which is the corpus's sample order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specprefetch.data.workloads import read_workload
from specprefetch.io import SpecPrefetchError, atomic_path, config_hash, provenance, sha256_file

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD, "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<image>"]
EXTRA_SPECIAL = SPECIAL_TOKENS[2:]
# What ``PreTrainedTokenizerFast.save_pretrained`` writes and ``AutoTokenizer`` needs to rebuild this tokenizer
# (without ``tokenizer_config.json`` it loads a tokenizer without the special tokens; without ``tokenizer.json``
# it cannot build one at all).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_tokenizer_files(tok_dir: str | Path, hint: str = "") -> None:
    """Every file of :data:`TOKENIZER_FILES` is in ``tok_dir``; else one line naming the directory and file."""
    tok_dir = Path(tok_dir)
    for name in TOKENIZER_FILES:
        if not (tok_dir / name).is_file():
            raise SpecPrefetchError(f"{tok_dir}: tokenizer file {name} missing" + (f" ({hint})" if hint else ""))


def load_tokenizer(tok_dir: str | Path, hint: str = "") -> Any:
    """``AutoTokenizer.from_pretrained(tok_dir)`` after :func:`check_tokenizer_files`; a file that is there but
    cannot be read is one line naming the directory (``hint``: what to run to remake it)."""
    from transformers import AutoTokenizer

    tok_dir = Path(tok_dir)
    check_tokenizer_files(tok_dir, hint)
    try:
        return AutoTokenizer.from_pretrained(tok_dir)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception for a malformed tokenizer.json
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SpecPrefetchError(f"{tok_dir}: cannot load the tokenizer ({type(exc).__name__}: {first})"
                                + (f"; {hint}" if hint else "")) from None


def corpus_texts(corpus_dir: Path) -> Iterator[str]:
    """Training text: each corpus sample's prompt and reference, in corpus order."""
    samples = read_workload(Path(corpus_dir))
    if any(s.split != "train" for s in samples):
        bad = next(s for s in samples if s.split != "train")
        raise SpecPrefetchError(f"{corpus_dir}: sample {bad.id!r} has split {bad.split!r}; the tokenizer trains "
                                "only on the training corpus (split 'train')")
    for s in samples:
        yield s.prompt
        yield s.reference


def build_bpe(texts: Iterator[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` with the contract's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(cfg: dict[str, Any], corpus_dir: Path, out_dir: Path) -> None:
    """Train the tokenizer on ``corpus_dir`` and save it as a ``PreTrainedTokenizerFast`` into ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    if "tokenizer" not in cfg:
        raise SpecPrefetchError("invalid config key 'tokenizer': missing (needed to train the stand-ins' tokenizer)")
    tcfg = cfg["tokenizer"]
    vocab_size = int(tcfg["vocab_size"])
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise SpecPrefetchError(f"invalid config key 'tokenizer.vocab_size': {vocab_size} is smaller than the 256 "
                                f"byte tokens plus {len(SPECIAL_TOKENS)} special tokens")
    log.info("training byte-level BPE (vocab %d) on %s", vocab_size, corpus_dir)
    tok = build_bpe(corpus_texts(corpus_dir), vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=EXTRA_SPECIAL, model_max_length=1_000_000, padding_side="right",
        clean_up_tokenization_spaces=False)
    for t in SPECIAL_TOKENS:
        ids = fast.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise SpecPrefetchError(f"tokenizer: special token {t!r} encodes to {len(ids)} tokens, expected 1")
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        fast.save_pretrained(str(tmp))
        info = {
            "format": "specprefetch-tokenizer/1",
            "vocab_size": fast.vocab_size if hasattr(fast, "vocab_size") else len(fast),
            "len": len(fast),
            "special_tokens": {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
            "corpus_samples_sha256": sha256_file(Path(corpus_dir) / "samples.jsonl"),
            "provenance": provenance({"tokenizer": tcfg}, seed=int(tcfg["seed"]),
                                     tokenizer_config_hash=config_hash(tcfg)),
        }
        (tmp / "specprefetch_tokenizer.json").write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")
    log.info("wrote tokenizer to %s (%d tokens)", out_dir, len(fast))
