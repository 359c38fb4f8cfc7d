"""Tiny MoE stand-ins that mirror the routing shape of the paper's models, built from transformers' own classes.

- ``qwen3_vl_moe`` (Qwen3-VL-30B-A3B): a ``Qwen3VLMoeForConditionalGeneration`` with a small vision tower
  (patch 16, spatial merge 2, out_hidden_size = text hidden), every text layer MoE, images as
  ``<|vision_start|><|image_pad|>*N<|vision_end|>`` with ``mm_token_type_ids``; ``Qwen2VLImageProcessorPil``.
- ``deepseek_vl2_standin`` (DeepSeek-VL2-Tiny): built like DeepSeek-VL2 -- a vision encoder
  (``SiglipVisionModel``), a 2x2-downsample + 2-layer MLP projector, and a ``DeepseekV2ForCausalLM``
  (routed + shared experts, first layer(s) dense, softmax greedy top-k); image features replace the embeddings of
  ``<image>`` placeholder tokens. Saved as subfolders (``vision/``, ``language/``), ``projector.safetensors`` and
  ``specprefetch_model.json``; loaded back with the same transformers classes.

Both are saved with safetensors, with the tokenizer and image processor in the same directory. The experts
run transformers' default ``grouped_mm`` implementation: measured 2-3x faster than ``eager`` for training on
CPU, and bit-reproducible under ``torch.use_deterministic_algorithms(True)`` (set by ``seed_everything``).

``specprefetch_model.json`` (format ``specprefetch-standin/2``) records the sha256 and size of every weight file
under the directory (``weights``: relative path -> ``{"sha256", "bytes"}``); loading checks them, and that no
other weight file is there, before transformers reads any weights, then requires every parameter to be filled
from the checkpoint (nothing missing, unexpected or of another shape).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.config import ConfigError
from specprefetch.contracts import STANDIN_FORMAT, ContractError, member, read_doc, require, reraise_as
from specprefetch.io import SpecPrefetchError, sha256_file, write_json_atomic
from specprefetch.models.deepseek_vl2 import Projector

log = logging.getLogger(__name__)

# /2: ``weights`` records {relative path: {"sha256", "bytes"}} of every weight file; /1 recorded none.
META_FILE = "specprefetch_model.json"
PROJECTOR_FILE = "projector.safetensors"
STANDIN_ARCHS = ("qwen3_vl_moe", "deepseek_vl2_standin")
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<image>")
VISION_HIDDEN = 64  # width of the stand-ins' vision towers (tiny: images carry little information here)
VISION_DEPTH = 2
SPATIAL_MERGE = 2   # Qwen3-VL merges 2x2 patches; DeepSeek-VL2 downsamples 2x2 before its projector
TEMPORAL_PATCH = 2  # Qwen3-VL's temporal patch (an image is repeated over it)


# Files whose bytes become weights: transformers reads safetensors (sharded: through the index) and, where
# there is none, PyTorch pickles; any of them is listed, so an added one is noticed.
WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")
# Router gates of every supported arch: ``[n_experts, hidden_size]`` (``nn.Linear`` weight layout).
_GATE_TENSOR = re.compile(r"(?:^|\.)(?:mlp|block_sparse_moe)\.gate\.weight$")
# Checkpoint config keys (config.json; the text part of a multimodal one) of each model key of the config,
# in transformers' precedence (Qwen3-VL-MoE saves num_experts as num_local_experts).
CHECKPOINT_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("n_experts", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("top_k", ("num_experts_per_tok",)),
    ("hidden_size", ("hidden_size",)),
    ("num_hidden_layers", ("num_hidden_layers",)),
    ("n_shared_experts", ("n_shared_experts",)),
)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RERUN = "re-run pretrain-stand-in"


class StandInError(SpecPrefetchError):
    """A stand-in cannot be built, saved or loaded; the message names the file or key."""


class WeightsError(StandInError):
    """A weight file is missing, corrupt, truncated, replaced or unlisted; the message names it."""


@dataclass
class StandIn:
    """A stand-in model with its tokenizer, image processor and metadata (``specprefetch_model.json``)."""

    model: nn.Module
    tokenizer: Any
    image_processor: Any
    meta: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ tokenizer
def special_token_ids(tokenizer: Any, where: str = "tokenizer") -> dict[str, int]:
    """Ids of the contract's special tokens; each must be one token of the vocabulary."""
    ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        enc = tokenizer(tok, add_special_tokens=False)["input_ids"]
        tid = tokenizer.convert_tokens_to_ids(tok)
        if len(enc) != 1 or tid is None or tid == getattr(tokenizer, "unk_token_id", None) or enc[0] != tid:
            raise StandInError(f"{where}: special token {tok!r} is not a single token (encodes to {enc}); "
                               "build the tokenizer with the contract's special tokens")
        ids[tok] = int(tid)
    return ids


def _heads(hidden: int) -> tuple[int, int, int]:
    """(attention heads, kv heads, head_dim) for a tiny width: head_dim 32 where possible, at least 2 heads."""
    heads = max(2, hidden // 32)
    if hidden % heads:
        raise StandInError(f"hidden_size={hidden} must be divisible by {heads} attention heads")
    return heads, max(1, heads // 2), hidden // heads


def moe_intermediate_size(hidden: int) -> int:
    """Expert FFN width: hidden/2 (small experts keep the 128-expert stand-in trainable on a CPU)."""
    return max(8, hidden // 2)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL splits head_dim/2 rotary frequencies over (t, h, w) as 24:20:20 of 64; scale that."""
    half = head_dim // 2
    hw = round(half * 20 / 64)
    return [half - 2 * hw, hw, hw]


def _image_grid_side(image_cfg: dict[str, Any]) -> int:
    return max(2, math.ceil(int(image_cfg["size"]) / int(image_cfg["patch_size"])))


# ------------------------------------------------------------------------------------------ Qwen3-VL-MoE
def qwen_image_processor(image_cfg: dict[str, Any]) -> Any:
    """Qwen2-VL image processor (PIL backend: no torchvision, same bytes everywhere) for patch 16, merge 2.

    ``longest_edge`` (max pixels) = size^2 keeps a size x size image at its size when size is a multiple of
    patch*merge (224 -> 14x14 patches -> 49 tokens); others round down to the nearest multiple.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch, size = int(image_cfg["patch_size"]), int(image_cfg["size"])
    factor = patch * SPATIAL_MERGE
    return Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=SPATIAL_MERGE, temporal_patch_size=TEMPORAL_PATCH,
        size={"shortest_edge": factor * factor, "longest_edge": max(size * size, factor * factor)},
    )


def qwen3_vl_moe_config(mcfg: dict[str, Any], image_cfg: dict[str, Any], ids: dict[str, int], vocab: int) -> Any:
    from transformers import Qwen3VLMoeConfig

    d = int(mcfg["hidden_size"])
    heads, kv, head_dim = _heads(d)
    first_dense = int(mcfg["first_dense_layers"])
    n_layers = int(mcfg["num_hidden_layers"])
    if int(mcfg["n_shared_experts"]):
        raise StandInError("qwen3_vl_moe has no shared experts: set n_shared_experts: 0")
    max_pos = 4 * max(int(mcfg["max_length"]), int(mcfg["pretrain"]["seq_len"]))
    g = _image_grid_side(image_cfg)
    text = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        moe_intermediate_size=moe_intermediate_size(d), num_experts=int(mcfg["n_experts"]),
        num_experts_per_tok=int(mcfg["top_k"]), decoder_sparse_step=1, mlp_only_layers=list(range(first_dense)),
        max_position_embeddings=max_pos, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim),
                         "mrope_interleaved": True},
        router_aux_loss_coef=float(mcfg["pretrain"]["aux_loss_coef"]),
        pad_token_id=ids["<|pad|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN, num_heads=2,
        patch_size=int(image_cfg["patch_size"]), spatial_merge_size=SPATIAL_MERGE,
        temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=d, num_position_embeddings=g * g,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


def build_qwen3_vl_moe(mcfg: dict[str, Any], image_cfg: dict[str, Any], tokenizer: Any) -> StandIn:
    from transformers import Qwen3VLMoeForConditionalGeneration

    ids = special_token_ids(tokenizer)
    model = Qwen3VLMoeForConditionalGeneration(qwen3_vl_moe_config(mcfg, image_cfg, ids, len(tokenizer)))
    meta = {"arch": "qwen3_vl_moe", "image_token": "<|image_pad|>", "special_token_ids": ids,
            "image": {"size": int(image_cfg["size"]), "patch_size": int(image_cfg["patch_size"]),
                      "spatial_merge": SPATIAL_MERGE}}
    return StandIn(model=model, tokenizer=tokenizer, image_processor=qwen_image_processor(image_cfg), meta=meta)


# ------------------------------------------------------------------------------------------ DeepSeek-VL2 stand-in
class DeepseekVL2StandInConfig:
    """Identifies the composite to :func:`discover_routing` (``model_type``) and holds its parts' configs."""

    model_type = "deepseek_vl2_standin"

    def __init__(self, language_config: Any, vision_config: Any, image_token_id: int, downsample: int) -> None:
        self.language_config = language_config
        self.vision_config = vision_config
        self.image_token_id = image_token_id
        self.downsample = downsample

    @property
    def hidden_size(self) -> int:
        return int(self.language_config.hidden_size)


class DeepseekVL2StandIn(nn.Module):
    """Vision encoder + projector + DeepSeek-V2 MoE language model, wired as DeepSeek-VL2 wires them."""

    def __init__(self, vision: nn.Module, projector: Projector, language: nn.Module, image_token_id: int) -> None:
        super().__init__()
        self.vision = vision
        self.projector = projector
        self.language = language
        self.config = DeepseekVL2StandInConfig(language.config, vision.config, image_token_id, projector.downsample)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.language.parameters()).dtype

    def image_features(self, pixel_values: Tensor) -> Tensor:
        """``[n_images, 3, H, W]`` -> ``[n_images, N, D]`` language-space image embeddings."""
        feats = self.vision(pixel_values=pixel_values.to(self.dtype)).last_hidden_state
        return self.projector(feats)

    def n_image_tokens(self) -> int:
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        return math.ceil(side / self.projector.downsample) ** 2

    def embed(self, input_ids: Tensor, pixel_values: Tensor | None = None) -> Tensor:
        """Token embeddings with the image features scattered over the ``<image>`` placeholders, in order."""
        embeds = self.language.get_input_embeddings()(input_ids)
        mask = input_ids == self.config.image_token_id
        n_slots = int(mask.sum())
        if pixel_values is None or pixel_values.numel() == 0:
            if n_slots:
                raise StandInError(f"{n_slots} <image> placeholder tokens but no pixel_values")
            return embeds
        feats = self.image_features(pixel_values).reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        if feats.shape[0] != n_slots:
            raise StandInError(f"{n_slots} <image> placeholder tokens but {feats.shape[0]} image features "
                               f"({pixel_values.shape[0]} images x {self.n_image_tokens()})")
        return embeds.masked_scatter(mask.unsqueeze(-1), feats)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, pixel_values: Tensor | None = None,
                **kwargs: Any) -> Any:
        return self.language(inputs_embeds=self.embed(input_ids, pixel_values), attention_mask=attention_mask,
                             **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, pixel_values: Tensor | None = None,
                 **kwargs: Any) -> Tensor:
        """Greedy/sampled generation; returns the prompt ids followed by the new ids (as transformers does)."""
        return self.language.generate(input_ids=input_ids, inputs_embeds=self.embed(input_ids, pixel_values),
                                      attention_mask=attention_mask, **kwargs)


def siglip_image_processor(image_cfg: dict[str, Any]) -> Any:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    size = int(image_cfg["size"])
    return SiglipImageProcessorPil(size={"height": size, "width": size})


def deepseek_language_config(mcfg: dict[str, Any], ids: dict[str, int], vocab: int) -> Any:
    from transformers import DeepseekV2Config

    d = int(mcfg["hidden_size"])
    heads, _, head_dim = _heads(d)
    rope = max(4, head_dim // 2)
    max_pos = 4 * max(int(mcfg["max_length"]), int(mcfg["pretrain"]["seq_len"]))
    return DeepseekV2Config(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=int(mcfg["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=heads,
        # MLA dims, small: compressed KV of width d/4, no q compression (as DeepSeek-VL2-Tiny, q_lora_rank None)
        kv_lora_rank=max(8, d // 4), q_lora_rank=None, qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope,
        v_head_dim=head_dim, n_routed_experts=int(mcfg["n_experts"]),
        n_shared_experts=int(mcfg["n_shared_experts"]), num_experts_per_tok=int(mcfg["top_k"]),
        moe_intermediate_size=moe_intermediate_size(d), first_k_dense_replace=int(mcfg["first_dense_layers"]),
        topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=max_pos, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=ids["<|pad|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
    )


def build_deepseek_vl2_standin(mcfg: dict[str, Any], image_cfg: dict[str, Any], tokenizer: Any) -> StandIn:
    from transformers import DeepseekV2ForCausalLM, SiglipVisionConfig, SiglipVisionModel

    ids = special_token_ids(tokenizer)
    d = int(mcfg["hidden_size"])
    vcfg = SiglipVisionConfig(hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN,
                              num_hidden_layers=VISION_DEPTH, num_attention_heads=2,
                              image_size=int(image_cfg["size"]), patch_size=int(image_cfg["patch_size"]))
    model = DeepseekVL2StandIn(SiglipVisionModel(vcfg), Projector(VISION_HIDDEN, d),
                               DeepseekV2ForCausalLM(deepseek_language_config(mcfg, ids, len(tokenizer))),
                               ids["<image>"])
    meta = {"arch": "deepseek_vl2_standin", "image_token": "<image>", "special_token_ids": ids,
            "image": {"size": int(image_cfg["size"]), "patch_size": int(image_cfg["patch_size"]),
                      "downsample": SPATIAL_MERGE},
            "projector": {"vision_dim": VISION_HIDDEN, "hidden": d, "downsample": SPATIAL_MERGE}}
    return StandIn(model=model, tokenizer=tokenizer, image_processor=siglip_image_processor(image_cfg), meta=meta)


# ------------------------------------------------------------------------------------------ build / save / load
def build_stand_in(cfg: dict[str, Any], model_name: str, tokenizer: Any) -> StandIn:
    """A freshly initialised stand-in for ``cfg["models"][model_name]`` (seed torch before calling)."""
    mcfg = cfg["models"].get(model_name)
    if mcfg is None:
        raise StandInError(f"unknown model {model_name!r}; config models: {', '.join(cfg['models'])}")
    arch = mcfg["arch"]
    builders = {"qwen3_vl_moe": build_qwen3_vl_moe, "deepseek_vl2_standin": build_deepseek_vl2_standin}
    if arch not in builders:
        raise StandInError(f"invalid config key 'models.{model_name}.arch': no stand-in for {arch!r} "
                           f"(stand-ins: {', '.join(builders)})")
    stand_in = builders[arch](mcfg, cfg["image"], tokenizer)
    stand_in.meta.update({"format": STANDIN_FORMAT, "model_name": model_name})
    return stand_in


def save_stand_in(stand_in: StandIn, out_dir: Path) -> None:
    """Write the stand-in into ``out_dir`` (an empty dir, e.g. the temp dir of ``atomic_path``)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = stand_in.model
    if isinstance(model, DeepseekVL2StandIn):
        model.vision.save_pretrained(out_dir / "vision")
        model.language.save_pretrained(out_dir / "language")
        state = {k: v.detach().cpu().contiguous() for k, v in model.projector.state_dict().items()}
        save_file(state, str(out_dir / PROJECTOR_FILE), metadata={"format": "pt"})
    else:
        model.save_pretrained(out_dir)
    stand_in.tokenizer.save_pretrained(out_dir)
    stand_in.image_processor.save_pretrained(out_dir)
    stand_in.meta["format"] = STANDIN_FORMAT
    stand_in.meta["weights"] = record_weights(out_dir)
    write_json_atomic(out_dir / META_FILE, stand_in.meta)


def read_meta(model_dir: Path) -> dict[str, Any]:
    """The stand-in's ``specprefetch_model.json``, checked: format, arch and the ``weights`` record."""
    path = Path(model_dir) / META_FILE
    if not path.is_file():
        raise StandInError(f"{path}: not found (is {model_dir} a stand-in saved by pretrain-stand-in?)")
    with reraise_as(StandInError):
        meta = read_doc(path, None, "stand-in metadata")
    fmt = meta.get("format")
    if isinstance(fmt, str) and fmt.startswith("specprefetch-standin/") and fmt != STANDIN_FORMAT:
        raise StandInError(f"{path}: format {fmt!r} is not the current {STANDIN_FORMAT!r} (older stand-ins record "
                           f"no weight checksums); {_RERUN}")
    if fmt != STANDIN_FORMAT or meta.get("arch") not in STANDIN_ARCHS:
        raise StandInError(f"{path}: format {fmt!r} / arch {meta.get('arch')!r} is not a "
                           f"{STANDIN_FORMAT} stand-in of {', '.join(STANDIN_ARCHS)}")
    check_weights_record(meta.get("weights"), path)
    return meta


# ------------------------------------------------------------------------------------------ weight integrity
def weight_files(model_dir: Path) -> list[str]:
    """Every weight file (:data:`WEIGHT_GLOBS`) under ``model_dir``, subdirectories included, as sorted
    relative POSIX paths."""
    root = Path(model_dir)
    found = {p.relative_to(root).as_posix() for pattern in WEIGHT_GLOBS for p in root.rglob(pattern)
             if p.is_file() or p.is_symlink()}
    return sorted(found)


def record_weights(model_dir: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` of every weight file under ``model_dir`` (streamed)."""
    root = Path(model_dir)
    return {rel: {"sha256": sha256_file(root / rel), "bytes": (root / rel).stat().st_size}
            for rel in weight_files(root)}


def is_plain_relpath(name: Any, root: Path) -> bool:
    """A relative path that stays inside ``root`` (:func:`specprefetch.contracts.member` accepts it)."""
    try:
        member(root, name, "weights record")
    except ContractError:
        return False
    return True


def check_weights_record(weights: Any, meta_path: Path) -> None:
    """The ``weights`` record is well formed: a non-empty object of plain relative paths to sha256 and size."""
    if not isinstance(weights, dict) or not weights:
        raise StandInError(f"{meta_path}: no 'weights' record (sha256 of every weight file); {_RERUN}")
    for name, rec in weights.items():
        if not is_plain_relpath(name, meta_path.parent):
            raise StandInError(f"{meta_path}: weight file name {name!r} is not a plain relative path inside the "
                               f"model directory (no '..', no absolute paths); {_RERUN}")
        if (not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str)
                or not _SHA256.fullmatch(rec["sha256"]) or type(rec.get("bytes")) is not int or rec["bytes"] < 0):
            raise StandInError(f"{meta_path}: weights[{name!r}] must be {{\"sha256\": 64 hex digits, \"bytes\": a "
                               f"size}}, got {rec!r}; {_RERUN}")


def verify_weights(model_dir: Path, weights: dict[str, dict[str, Any]], meta_path: Path) -> None:
    """Every recorded weight file is there with its recorded size and sha256, and no other weight file is.

    Runs before any weights are read: a flipped byte, a truncated, replaced, missing or added file is one line
    naming it.
    """
    root = Path(model_dir)
    check_weights_record(weights, meta_path)
    extra = sorted(set(weight_files(root)) - set(weights))
    if extra:
        raise WeightsError(f"{root / extra[0]}: weight file not recorded in {meta_path} (unexpected or planted "
                           f"weights{f'; {len(extra) - 1} more' if len(extra) > 1 else ''})")
    for name, rec in sorted(weights.items()):
        path = root / name
        if not path.is_file():
            raise WeightsError(f"{path}: weight file missing (recorded in {meta_path}); {_RERUN}")
        try:
            size = path.stat().st_size
            same = size == rec["bytes"] and sha256_file(path) == rec["sha256"]
        except OSError as exc:
            raise WeightsError(f"{path}: unreadable ({exc.strerror or exc})") from None
        if not same:
            note = f"; {size} bytes where {rec['bytes']} were recorded" if size != rec["bytes"] else ""
            raise WeightsError(f"{path}: sha256 does not match the one recorded in {meta_path} (corrupt or "
                               f"replaced weights{note})")


def verify_stand_in(model_dir: Path) -> dict[str, Any]:
    """Check a stand-in directory's weights against its record without loading it (for code that reads its
    safetensors directly); returns the metadata."""
    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    verify_weights(model_dir, meta["weights"], model_dir / META_FILE)
    return meta


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file (``{name: {"dtype", "shape", "data_offsets"}}``), read from its
    header only; a truncated or corrupt file is one line naming it (safetensors' own errors do not)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if n < 0 or n > size - 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, "
                                   f"{'no header' if n < 0 else f'its header alone is {n} bytes'})")
            head = f.read(n)
    except OSError as exc:
        raise WeightsError(f"{path}: unreadable ({exc.strerror or exc})") from None
    try:
        table = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: corrupt safetensors file (its header is not valid JSON)") from None
    if not isinstance(table, dict):
        raise WeightsError(f"{path}: corrupt safetensors file (its header is not a JSON object)")
    end = 0
    tensors: dict[str, Any] = {}
    for name, t in table.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] or not isinstance(t.get("shape"), list)):
            raise WeightsError(f"{path}: corrupt safetensors file (bad header entry for tensor {name!r})")
        end = max(end, offs[1])
        tensors[name] = t
    expected = 8 + n + end
    if size < expected:
        raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, its header describes {expected})")
    if size > expected:
        raise WeightsError(f"{path}: corrupt safetensors file ({size} bytes, its header describes {expected})")
    return tensors


def _read_config_json(path: Path) -> dict[str, Any]:
    with reraise_as(StandInError):
        return read_doc(path, None, "checkpoint config")


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a checkpoint config (Qwen3-VL: text_config; DeepSeek-VL2: language_config)."""
    for key in ("text_config", "language_config"):
        if isinstance(cfg.get(key), dict):
            return cfg[key]
    return cfg


def _checkpoint_value(text: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if text.get(name) is not None:
            return name, text[name]
    return None


def check_checkpoint_config(config_path: Path, mcfg: dict[str, Any], model_name: str) -> None:
    """The checkpoint's ``config.json`` agrees with the config's model entry (expert count, top-k, width, depth,
    shared experts), checked before any weights are loaded: one line naming the file, both keys and values."""
    text = _text_part(_read_config_json(config_path))
    for key, names in CHECKPOINT_KEYS:
        found = _checkpoint_value(text, names)
        if found is None or (key not in mcfg and key != "n_shared_experts"):
            continue
        ck_name, ck_value = found
        want = int(mcfg.get(key, 0) or 0)
        try:
            same = int(ck_value) == want
        except (TypeError, ValueError):
            raise StandInError(f"{config_path}: {ck_name}={ck_value!r} is not an integer") from None
        if not same:
            raise ConfigError(f"{config_path}: the checkpoint has {ck_name}={ck_value}, but config key "
                              f"'models.{model_name}.{key}' is {want} (wrong checkpoint, or fix the config)")


def check_weights_match_config(model_dir: Path, config_path: Path | None = None) -> None:
    """Every safetensors file directly in ``model_dir`` is whole (see :func:`safetensors_header`), the shards
    an index names exist, and the router gates' shapes ``[n_experts, hidden_size]`` agree with ``config.json``
    (else transformers fails with "look at the above report" or silently re-initialises them)."""
    model_dir = Path(model_dir)
    config_path = config_path or model_dir / "config.json"
    for index in sorted(model_dir.glob("*.safetensors.index.json")):
        with reraise_as(WeightsError):
            weight_map = require(read_doc(index, None, "safetensors index"), "weight_map", dict, str(index))
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not is_plain_relpath(shard, model_dir):
                raise WeightsError(f"{index}: shard name {shard!r} is not a plain relative path inside {model_dir}")
            if not (model_dir / shard).is_file():
                raise WeightsError(f"{model_dir / shard}: weight shard missing (listed in {index})")
    text = _text_part(_read_config_json(config_path)) if config_path.is_file() else {}
    n_experts = _checkpoint_value(text, CHECKPOINT_KEYS[0][1])
    hidden = text.get("hidden_size")
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, t in safetensors_header(path).items():
            shape = t["shape"]
            if not _GATE_TENSOR.search(name) or len(shape) != 2:
                continue
            if n_experts is not None and shape[0] != n_experts[1]:
                raise WeightsError(f"{path}: tensor {name} has {shape[0]} experts (shape {shape}), but "
                                   f"{config_path} says {n_experts[0]}={n_experts[1]} (the weights and config.json "
                                   "are from different models)")
            if hidden is not None and shape[1] != hidden:
                raise WeightsError(f"{path}: tensor {name} has hidden size {shape[1]} (shape {shape}), but "
                                   f"{config_path} says hidden_size={hidden} (the weights and config.json are "
                                   "from different models)")


def _shape(v: Any) -> str:
    return str(list(v)) if isinstance(v, (tuple, list, torch.Size)) else str(v)


def _from_pretrained(cls: Any, where: Path) -> Any:
    """``cls.from_pretrained(where)`` that must fill every parameter: a key missing, unexpected or of another
    shape means the weights are corrupt or from another model than ``where/config.json`` (transformers would
    re-initialise those parameters and go on, or fail with "look at the above report"); one line naming them.
    Its load report is not printed: everything in it is in the error."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = cls.from_pretrained(where, dtype=torch.float32, output_loading_info=True,
                                          ignore_mismatched_sizes=True)
    finally:
        hf_logging.set_verbosity(level)
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0] if isinstance(m, tuple) else m))
    if mismatched:
        first = mismatched[0]
        what = (f"{first[0]} is {_shape(first[1])} in the weights, {_shape(first[2])} by config.json"
                if isinstance(first, tuple) and len(first) == 3 else str(first))
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        raise WeightsError(f"{where}: tensor shapes of the weights do not match {where / 'config.json'} ({what}"
                           f"{more}; the weights and config.json are from different models)")
    for kind in ("missing_keys", "unexpected_keys"):
        keys = sorted(str(k) for k in info.get(kind) or ())
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise WeightsError(f"{where}: the weights do not fit the model of {where / 'config.json'} "
                               f"({kind.replace('_', ' ')}: {', '.join(keys[:3])}{more}; corrupt or replaced weights)")
    return model


def _load_error(model_dir: Path, exc: BaseException) -> StandInError:
    msg = (str(exc).strip().splitlines() or [""])[0]
    return StandInError(f"cannot load stand-in from {model_dir}: {type(exc).__name__}: {msg}")


def load_stand_in(model_dir: Path, device: str | torch.device = "cpu", mcfg: dict[str, Any] | None = None,
                  model_name: str | None = None) -> StandIn:
    """Load a saved stand-in with transformers' own classes (safetensors), in eval mode on ``device``.

    Before any weights are read: the recorded sha256 of every weight file (and that no other is there), the
    tokenizer files, and -- given the config's model entry ``mcfg`` -- the checkpoint's config.json against it.
    """
    from safetensors import SafetensorError

    from specprefetch.data.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    meta = verify_stand_in(model_dir)
    tokenizer = load_tokenizer(model_dir, hint=_RERUN)
    special_token_ids(tokenizer, where=str(model_dir))
    parts = [model_dir] if meta["arch"] == "qwen3_vl_moe" else [model_dir / "vision", model_dir / "language"]
    for part in parts:
        if not (part / "config.json").is_file():
            raise StandInError(f"{part / 'config.json'}: missing; {_RERUN}")
        check_weights_match_config(part)
    if mcfg is not None:
        check_checkpoint_config(parts[-1] / "config.json", mcfg, model_name or str(meta.get("model_name")))
    try:
        if meta["arch"] == "qwen3_vl_moe":
            from transformers import Qwen3VLMoeForConditionalGeneration
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            model: nn.Module = _from_pretrained(Qwen3VLMoeForConditionalGeneration, model_dir)
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        else:
            from safetensors.torch import load_file
            from transformers import DeepseekV2ForCausalLM, SiglipVisionModel
            from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

            vision = _from_pretrained(SiglipVisionModel, model_dir / "vision")
            language = _from_pretrained(DeepseekV2ForCausalLM, model_dir / "language")
            p = meta["projector"]
            projector = Projector(int(p["vision_dim"]), int(p["hidden"]), downsample=int(p["downsample"]))
            safetensors_header(model_dir / PROJECTOR_FILE)
            try:
                projector.load_state_dict(load_file(str(model_dir / PROJECTOR_FILE)))
            except RuntimeError as exc:
                raise WeightsError(f"{model_dir / PROJECTOR_FILE}: the weights do not fit the projector "
                                   f"({(str(exc).splitlines() or [''])[0]})") from None
            model = DeepseekVL2StandIn(vision, projector, language, int(meta["special_token_ids"]["<image>"]))
            image_processor = SiglipImageProcessorPil.from_pretrained(model_dir)
    except SpecPrefetchError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise _load_error(model_dir, exc) from exc
    model.to(device).eval()
    return StandIn(model=model, tokenizer=tokenizer, image_processor=image_processor, meta=meta)
