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
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specprefetch.io import SpecPrefetchError

log = logging.getLogger(__name__)

STANDIN_FORMAT = "specprefetch-standin/1"
META_FILE = "specprefetch_model.json"
PROJECTOR_FILE = "projector.safetensors"
STANDIN_ARCHS = ("qwen3_vl_moe", "deepseek_vl2_standin")
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<image>")
VISION_HIDDEN = 64  # width of the stand-ins' vision towers (tiny: images carry little information here)
VISION_DEPTH = 2
SPATIAL_MERGE = 2   # Qwen3-VL merges 2x2 patches; DeepSeek-VL2 downsamples 2x2 before its projector
TEMPORAL_PATCH = 2  # Qwen3-VL's temporal patch (an image is repeated over it)


class StandInError(SpecPrefetchError):
    """A stand-in cannot be built, saved or loaded; the message names the file or key."""


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
    first_dense = int(mcfg.get("first_dense_layers", 0))
    n_layers = int(mcfg["num_hidden_layers"])
    if int(mcfg.get("n_shared_experts", 0)):
        raise StandInError("qwen3_vl_moe has no shared experts: set n_shared_experts: 0")
    max_pos = 4 * max(int(mcfg["max_length"]), int(mcfg.get("pretrain", {}).get("seq_len", 0)))
    g = _image_grid_side(image_cfg)
    text = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        moe_intermediate_size=moe_intermediate_size(d), num_experts=int(mcfg["n_experts"]),
        num_experts_per_tok=int(mcfg["top_k"]), decoder_sparse_step=1, mlp_only_layers=list(range(first_dense)),
        max_position_embeddings=max_pos, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim),
                         "mrope_interleaved": True},
        router_aux_loss_coef=float(mcfg.get("pretrain", {}).get("aux_loss_coef", 0.0)),
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


class Projector(nn.Module):
    """DeepSeek-VL2's ``downsample_mlp_gelu`` adaptor: 2x2 patch concat (pad odd grids), then a 2-layer MLP."""

    def __init__(self, vision_dim: int, hidden: int, downsample: int = SPATIAL_MERGE) -> None:
        super().__init__()
        self.downsample = downsample
        self.layers = nn.Sequential(nn.Linear(vision_dim * downsample * downsample, hidden), nn.GELU(),
                                    nn.Linear(hidden, hidden))

    def forward(self, x: Tensor) -> Tensor:
        b, p, c = x.shape
        side = math.isqrt(p)
        if side * side != p:
            raise StandInError(f"vision features of {p} patches are not a square grid")
        x = x.reshape(b, side, side, c)
        pad = (-side) % self.downsample
        if pad:
            x = F.pad(x, (0, 0, 0, pad, 0, pad))
        x = F.unfold(x.permute(0, 3, 1, 2), kernel_size=self.downsample, stride=self.downsample)
        return self.layers(x.permute(0, 2, 1))


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
    max_pos = 4 * max(int(mcfg["max_length"]), int(mcfg.get("pretrain", {}).get("seq_len", 0)))
    return DeepseekV2Config(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=int(mcfg["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=heads,
        # MLA dims, small: compressed KV of width d/4, no q compression (as DeepSeek-VL2-Tiny, q_lora_rank None)
        kv_lora_rank=max(8, d // 4), q_lora_rank=None, qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope,
        v_head_dim=head_dim, n_routed_experts=int(mcfg["n_experts"]),
        n_shared_experts=int(mcfg.get("n_shared_experts", 0)), num_experts_per_tok=int(mcfg["top_k"]),
        moe_intermediate_size=moe_intermediate_size(d), first_k_dense_replace=int(mcfg.get("first_dense_layers", 0)),
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
    (out_dir / META_FILE).write_text(json.dumps(stand_in.meta, indent=2, sort_keys=True) + "\n")


def read_meta(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / META_FILE
    if not path.is_file():
        raise StandInError(f"{path}: not found (is {model_dir} a stand-in saved by pretrain-stand-in?)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StandInError(f"{path}: not valid JSON ({exc.msg})") from None
    if meta.get("format") != STANDIN_FORMAT or meta.get("arch") not in STANDIN_ARCHS:
        raise StandInError(f"{path}: format {meta.get('format')!r} / arch {meta.get('arch')!r} is not a "
                           f"{STANDIN_FORMAT} stand-in of {', '.join(STANDIN_ARCHS)}")
    return meta


def load_stand_in(model_dir: Path, device: str | torch.device = "cpu") -> StandIn:
    """Load a saved stand-in with transformers' own classes (safetensors), in eval mode on ``device``."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if meta["arch"] == "qwen3_vl_moe":
            from transformers import Qwen3VLMoeForConditionalGeneration
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            model: nn.Module = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        else:
            from safetensors.torch import load_file
            from transformers import DeepseekV2ForCausalLM, SiglipVisionModel
            from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

            vision = SiglipVisionModel.from_pretrained(model_dir / "vision", dtype=torch.float32)
            language = DeepseekV2ForCausalLM.from_pretrained(model_dir / "language", dtype=torch.float32)
            p = meta["projector"]
            projector = Projector(int(p["vision_dim"]), int(p["hidden"]), int(p["downsample"]))
            projector.load_state_dict(load_file(str(model_dir / PROJECTOR_FILE)))
            model = DeepseekVL2StandIn(vision, projector, language, int(meta["special_token_ids"]["<image>"]))
            image_processor = SiglipImageProcessorPil.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise StandInError(f"cannot load stand-in from {model_dir}: {type(exc).__name__}: {exc}") from exc
    special_token_ids(tokenizer, where=str(model_dir))
    model.to(device).eval()
    return StandIn(model=model, tokenizer=tokenizer, image_processor=image_processor, meta=meta)
