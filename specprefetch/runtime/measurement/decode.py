"""Greedy decoding with per-token timestamps, one prompt or a batch, and the benchmark prompts taken from a workload.

Decoding uses the model's own ``generate`` (so multimodal position handling stays the model's), greedy, with a
stopping criterion that only records the wall time at which every new token exists. Decoding throughput of a
prompt is ``(n_new - 1) / (t_last - t_first)``: the prefill and the first token are excluded, as the paper
reports decoding throughput.

:func:`prefill` runs a prompt's prefill alone (the first new token and the KV cache); ``greedy_generate(...,
start=...)`` then decodes the rest from a copy of that state, bit-identical to decoding from the prompt (the lockstep
benchmark computes one prefill for all the runs it pairs; the first token's time is then when decoding resumes).

A batch (beyond the paper's batch-1 runtime) is one :class:`Prompt` of ``B`` text prompts, left-padded by
:func:`collate` (transformers' convention for decoder-only generation: every sequence's next token is the last
column); its decoding step makes one token of every sequence, and its throughput counts all of them:
``B (n_new - 1) / (t_last - t_first)``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specprefetch.io import SpecPrefetchError

log = logging.getLogger(__name__)

PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "images_seq_mask")


@dataclass
class Prompt:
    """One benchmark prompt: its id and the forward kwargs of its prompt part (one sequence, or a batch of
    left-padded sequences from :func:`collate`)."""

    id: str
    kwargs: dict[str, Tensor]

    @property
    def n_tokens(self) -> int:
        """Prompt length in columns (the longest prompt of a batch)."""
        return int(self.kwargs["input_ids"].shape[1])

    @property
    def batch(self) -> int:
        return int(self.kwargs["input_ids"].shape[0])

    def to(self, device: torch.device | str) -> Prompt:
        return Prompt(self.id, {k: v.to(device) for k, v in self.kwargs.items()})


@dataclass
class Generation:
    """New token ids (one list per sequence of the batch) and the wall time at which each step's tokens were
    available."""

    prompt_id: str
    sequences: list[list[int]]
    times: list[float]

    @property
    def new_ids(self) -> list[int]:
        """The new tokens of a one-sequence generation."""
        if len(self.sequences) != 1:
            raise SpecPrefetchError(f"generation {self.prompt_id!r} decoded a batch of {len(self.sequences)}: "
                                    "use its sequences")
        return self.sequences[0]

    @property
    def decode_tokens(self) -> int:
        """Tokens decoded after the first step, over every sequence of the batch."""
        return max(0, len(self.times) - 1) * len(self.sequences)

    @property
    def decode_s(self) -> float:
        return self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0


class _TokenClock:
    """A stopping criterion that never stops: it timestamps each generated token, then calls ``between_tokens``
    (the lockstep harness hands the model to another run there)."""

    def __init__(self, sync: bool, between_tokens: Callable[[], None] | None = None) -> None:
        self.times: list[float] = []
        self.sync = sync
        self.between_tokens = between_tokens

    def __call__(self, input_ids: Tensor, scores: Any = None, **kwargs: Any) -> Tensor:
        if self.sync:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if self.between_tokens is not None:
            self.between_tokens()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def pad_id_of(model: Any, tokenizer: Any = None) -> int | None:
    for obj in (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(obj, name, None)
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return None


_GREEDY = {"do_sample": False, "num_beams": 1, "temperature": None, "top_p": None, "top_k": None}


@dataclass
class Prefilled:
    """A prompt after its prefill: the prompt ids followed by the first new token, and the KV cache over the
    prompt (copied by every decoding that starts from it)."""

    prompt_id: str
    n_prompt: int
    sequences: Tensor
    cache: Any
    attention_mask: Tensor  # the prompt's, with the first new token's column


@torch.no_grad()
def prefill(model: Any, prompt: Prompt, tokenizer: Any = None) -> Prefilled:
    """The prompt's prefill: one forward over the prompt and the first greedy token."""
    out = model.generate(**prompt.kwargs, max_new_tokens=1, min_new_tokens=1, pad_token_id=pad_id_of(model, tokenizer),
                         return_dict_in_generate=True, **_GREEDY)
    return Prefilled(prompt.id, prompt.n_tokens, out.sequences, out.cache, _extended_mask(prompt, out.sequences))


def _extended_mask(prompt: Prompt, seq: Tensor) -> Tensor:
    """The prompt's attention mask (ones where it has none) followed by ones for the new tokens of ``seq``."""
    mask = prompt.kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(prompt.kwargs["input_ids"])
    return torch.cat([mask, mask.new_ones(seq.shape[0], seq.shape[1] - mask.shape[1])], dim=1)


@torch.no_grad()
def greedy_generate(model: Any, prompt: Prompt, max_new_tokens: int, fixed_length: bool = True,
                    tokenizer: Any = None, between_tokens: Callable[[], None] | None = None,
                    start: Prefilled | None = None) -> Generation:
    """Greedy decoding of ``prompt``; ``fixed_length`` forbids EOS so every run decodes the same count;
    ``between_tokens`` is called after each new token is timestamped. ``start``: ``prompt``'s :func:`prefill`,
    decoded on from a copy of its state (the first token's time is now)."""
    from transformers import StoppingCriteriaList

    device = prompt.kwargs["input_ids"].device
    clock = _TokenClock(device.type == "cuda", between_tokens)
    n_in = prompt.n_tokens
    if start is None:
        kwargs, n_new = dict(prompt.kwargs), max_new_tokens
    else:
        if start.prompt_id != prompt.id or start.n_prompt != n_in:
            raise SpecPrefetchError(f"prefill of prompt {start.prompt_id!r} cannot start prompt {prompt.id!r}")
        seq = start.sequences
        kwargs = {"input_ids": seq, "attention_mask": start.attention_mask, "cache": copy.deepcopy(start.cache)}
        n_new = max_new_tokens - 1
        clock.times.append(time.perf_counter())
        if n_new <= 0:
            return Generation(prompt.id, [r[:max_new_tokens] for r in seq[:, n_in:].tolist()],
                              clock.times[:max_new_tokens])
    out = model.generate(
        **kwargs, max_new_tokens=n_new, min_new_tokens=n_new if fixed_length else None,
        pad_token_id=pad_id_of(model, tokenizer), stopping_criteria=StoppingCriteriaList([clock]), **_GREEDY,
    )
    seq = out if isinstance(out, Tensor) else out.sequences
    new = seq[:, n_in:].tolist() if seq.shape[1] > n_in else seq.tolist()
    return Generation(prompt.id, [[int(t) for t in row] for row in new], clock.times[: len(new[0])])


def collate(prompts: list[Prompt], pad_id: int) -> Prompt:
    """``prompts`` (text prompts of one sequence each) as one left-padded batch, named ``id1+id2+...``: pad tokens
    and a zero attention mask before the shorter prompts. Prompts with images cannot be batched here (their vision
    inputs are per-sample tensors of different shapes)."""
    if not prompts:
        raise SpecPrefetchError("a batch needs at least one prompt")
    if len(prompts) == 1:
        return prompts[0]
    for p in prompts:
        extra = sorted(set(p.kwargs) - {"input_ids", "attention_mask"})
        if extra or p.batch != 1:
            raise SpecPrefetchError(f"prompt {p.id!r} cannot join a batch: only one-sequence text prompts can "
                                    f"(it has {', '.join(extra) or f'a batch of {p.batch}'})")
    n = max(p.n_tokens for p in prompts)
    ids, mask = [], []
    for p in prompts:
        x = p.kwargs["input_ids"]
        m = p.kwargs.get("attention_mask", torch.ones_like(x))
        pad = n - x.shape[1]
        ids.append(torch.cat([x.new_full((1, pad), pad_id), x], dim=1))
        mask.append(torch.cat([m.new_zeros(1, pad), m], dim=1))
    return Prompt("+".join(p.id for p in prompts), {"input_ids": torch.cat(ids), "attention_mask": torch.cat(mask)})


def prompts_from_workload(bundle: Any, workload_dir: str | Path, n_prompts: int,
                          max_prompt_tokens: int | None = None) -> list[Prompt]:
    """The first ``n_prompts`` samples of a workload, encoded for ``bundle``'s model, prompt part only.

    ``encode_sample`` builds ``[image] prompt reference``; the runtime generates its own continuation, so the
    per-token tensors are cut at the prompt's end (images and their grids are kept whole). Text prompts longer
    than ``max_prompt_tokens`` keep their last tokens (never cutting an image).
    """
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import encode_sample

    root = Path(workload_dir)
    samples = read_workload(root)
    if not samples:
        raise SpecPrefetchError(f"{root}: workload has no samples")
    out = []
    for sample in samples[:n_prompts]:
        enc = encode_sample(bundle, sample, root)
        n_prompt = int(enc.is_prompt.sum())
        start = 0
        if max_prompt_tokens and n_prompt > max_prompt_tokens and not bool(enc.is_image.any()):
            start = n_prompt - max_prompt_tokens
        kwargs = {k: (v[:, start:n_prompt] if k in PER_TOKEN_KEYS else v) for k, v in enc.kwargs.items()}
        out.append(Prompt(enc.sample_id, kwargs))
    log.info("%d prompts from %s (%s tokens)", len(out), root, [p.n_tokens for p in out])
    return out
