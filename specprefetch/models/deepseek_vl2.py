"""DeepSeek-VL2 (Tiny, Small, Base) natively on transformers 5: our readable implementation of the official model.

The official package (github.com/deepseek-ai/DeepSeek-VL2) pins torch 2.0.1 and transformers 4.38 and imports
classes transformers has since removed, so it cannot load next to Qwen3-VL (transformers 5). This module rebuilds
the same network from transformers' own DeepSeek-V2 pieces where they fit and reads the hub checkpoints by their
own weight names:

- **Vision**: the SigLIP ViT in timm's layout (``vision.patch_embed.proj``, ``vision.pos_embed``,
  ``vision.blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``vision.norm``): pre-norm blocks,
  LayerNorm eps 1e-6, tanh-GELU, no class token; the final norm is applied and the attention-pool head
  (``vision.attn_pool.*``, ``ignore_head: true`` in every released config) is never run, so its weights are
  skipped on load.
- **Projector** ``downsample_mlp_gelu``: 2x2 patch concatenation (odd grids padded), then the MLP.
- **Tile tags** (``tile_tag: 2D``, ``global_view_pos: head``): per image, the global view's ``h x w`` grid with an
  ``image_newline`` after each row, ``view_seperator``, then the local tiles laid out as one
  ``(th*h) x (tw*w)`` grid with a newline after each row; the result fills the ``<image>`` positions in order.
- **Language**: transformers' ``DeepseekV2ForCausalLM`` built from :class:`TextModel` layers: multi-head attention
  (``use_mla: false``, DeepSeek-VL2-Tiny: the official code runs transformers 4's ``LlamaAttention`` with
  half-split RoPE) or transformers' MLA (``use_mla: true``), routed + shared experts in transformers' fused
  layout, ``first_k_dense_replace``/``moe_layer_freq`` dense layers, and a :class:`Router` with the official
  ``MoEGate`` semantics (softmax or sigmoid scores; greedy, group-limited greedy or ``noaux_tc`` with
  ``e_score_correction_bias``; ``norm_topk_prob``; ``routed_scaling_factor``).
- **Processor** (:class:`DeepseekVL2Processor`): the "deepseek" chat format, best-fit candidate resolution,
  mean-colour padding, one 384-px global view plus local tiles, and the ``<image>`` token count
  ``h (w + 1) + 1 + (th h)(tw w + 1)``.

The official checkpoint stores each routed expert as its own ``gate_proj``/``up_proj``/``down_proj``;
:func:`from_official_state_dict` stacks them into the fused ``gate_up_proj``/``down_proj`` tensors the
offloaded runtime serves, and :func:`to_official_state_dict` writes them back out (tests and the local hub
mirror build checkpoints in the official layout with it). Loading checks that every parameter is filled exactly
once with the right shape. ``tests/test_deepseek_vl2.py`` compares this implementation with the official
code's logits and per-layer routing on tiny random checkpoints (``scripts/deepseek_vl2_reference.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DeepseekV2Config, PreTrainedConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as dsv2

from specprefetch.contracts import load_safetensors, member, read_doc, require, reraise_as
from specprefetch.io import SpecPrefetchError
from specprefetch.models.selection import router_scores, select_experts

MODEL_TYPE = "deepseek_vl_v2"
PROCESSOR_CONFIG = "processor_config.json"
# Checkpoint tensors that no forward reads: the vision tower's attention-pool head (ignore_head in every config).
UNUSED_PREFIXES = ("vision.attn_pool.",)
# The official config classes' defaults (deepseek_vl2/models/modeling_deepseek_vl_v2.py, configuration_deepseek.py):
# a key missing from config.json means these values, exactly as the official code reads it.
VISION_DEFAULTS: dict[str, Any] = {"model_name": "siglip_large_patch16_384", "image_size": 384, "patch_size": 16,
                                   "width": 1024, "layers": 24, "heads": 16, "mlp_ratio": 4, "global_pool": "map",
                                   "ignore_head": True, "class_token": False, "num_classes": 0}
PROJECTOR_DEFAULTS: dict[str, Any] = {"projector_type": "downsample_mlp_gelu", "input_dim": 1152, "n_embed": 2048,
                                      "depth": 2, "mlp_ratio": 1, "downsample_ratio": 2, "token_pooling": False}
LANGUAGE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": None,
    "n_routed_experts": None, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "gready", "n_group": None,
    "topk_group": None, "num_experts_per_tok": None, "moe_layer_freq": 1, "first_k_dense_replace": 0,
    "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "pad_token_id": None, "bos_token_id": 100000, "eos_token_id": 100001,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "attention_dropout": 0.0, "use_mla": True,
}


class DeepseekVL2Error(SpecPrefetchError):
    """A DeepSeek-VL2 config, checkpoint or input is not what the model needs; the message names it."""


# ------------------------------------------------------------------------------------------ config
def _with_defaults(given: Mapping[str, Any] | None, defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in (given or {}).items() if k != "model_type"}}


def language_config(official: Mapping[str, Any]) -> DeepseekV2Config:
    """transformers' ``DeepseekV2Config`` for the official ``language_config`` (keys the official code reads).

    Multi-head attention (``use_mla: false``) has one head width ``hidden / heads`` for queries, keys, values and
    RoPE; the MLA fields of such a config (0 or null in DeepSeek-VL2-Tiny's) are replaced by it. The official
    ``topk_method`` default is the typo ``gready``, which its gate treats as no known method; a released config
    always names one.
    """
    c = _with_defaults(official, LANGUAGE_DEFAULTS)
    if c["n_routed_experts"] is None:
        raise DeepseekVL2Error("language_config.n_routed_experts is null: a dense DeepSeek-VL2 has no experts to route")
    if c["topk_method"] not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise DeepseekVL2Error(f"language_config.topk_method {c['topk_method']!r} is not one of greedy, "
                               "group_limited_greedy, noaux_tc")
    heads = int(c["num_attention_heads"])
    if int(c["hidden_size"]) % heads:
        raise DeepseekVL2Error(f"language_config.hidden_size {c['hidden_size']} is not divisible by "
                               f"num_attention_heads {heads}")
    scaling = dict(c["rope_scaling"] or {})
    rope = {"rope_type": scaling.pop("type", scaling.pop("rope_type", "default")), "rope_theta": float(c["rope_theta"]),
            **scaling}
    mla = bool(c["use_mla"])
    head = int(c["hidden_size"]) // heads
    attn = ({k: c[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim")}
            if mla else {"kv_lora_rank": 1, "q_lora_rank": None, "qk_rope_head_dim": head, "v_head_dim": head,
                         "qk_nope_head_dim": 0})
    keep = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_routed_experts", "routed_scaling_factor", "topk_method",
            "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id",
            "tie_word_embeddings", "attention_bias", "attention_dropout")
    cfg = DeepseekV2Config(**{k: c[k] for k in keep}, **attn, n_shared_experts=int(c["n_shared_experts"] or 0),
                           rope_parameters=rope)
    # What transformers' config has no field for; read by TextModel and Router.
    cfg.use_mla, cfg.scoring_func, cfg.moe_layer_freq = mla, str(c["scoring_func"]), int(c["moe_layer_freq"] or 1)
    cfg.has_shared_experts = c["n_shared_experts"] is not None
    return cfg


class DeepseekVL2Config(PreTrainedConfig):
    """config.json of a DeepSeek-VL2 checkpoint (``model_type: deepseek_vl_v2``), the official keys as they are.

    ``vision_config``/``projector_config``/``language_config`` stay the checkpoint's dicts (saved back unchanged);
    :attr:`vision`, :attr:`projector` hold them with the official defaults filled in and :attr:`text` is the
    transformers config the language model is built from.
    """

    model_type = MODEL_TYPE
    vision_config: dict | None = None
    projector_config: dict | None = None
    language_config: dict | None = None
    tile_tag: str = "2D"
    global_view_pos: str = "head"
    candidate_resolutions: list | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.tile_tag != "2D":
            raise DeepseekVL2Error(f"tile_tag {self.tile_tag!r}: only the released '2D' tile tags are supported")
        if self.global_view_pos not in ("head", "tail"):
            raise DeepseekVL2Error(f"global_view_pos {self.global_view_pos!r} is not 'head' or 'tail'")
        self.vision = _with_defaults(self.vision_config, VISION_DEFAULTS)
        self.projector = _with_defaults(self.projector_config, PROJECTOR_DEFAULTS)
        if self.projector["projector_type"] != "downsample_mlp_gelu" or self.projector["token_pooling"]:
            raise DeepseekVL2Error(f"projector_type {self.projector['projector_type']!r} (token_pooling "
                                   f"{self.projector['token_pooling']}): only the released downsample_mlp_gelu is "
                                   "supported")
        if not self.vision["ignore_head"] or self.vision["class_token"]:
            raise DeepseekVL2Error("vision_config: only ignore_head true without a class token (as released) is "
                                   "supported")
        self.text = language_config(self.language_config or {})

    @property
    def hidden_size(self) -> int:
        return int(self.text.hidden_size)


# ------------------------------------------------------------------------------------------ vision
class _PatchEmbed(nn.Module):
    def __init__(self, patch: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise DeepseekVL2Error(f"vision_config: width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class _Mlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = _Mlp(width, mlp_hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SiglipViT(nn.Module):
    """The SigLIP ViT as the official code builds it from timm (``ignore_head``: features after the final norm)."""

    def __init__(self, vision: Mapping[str, Any]) -> None:
        super().__init__()
        size, patch, width = int(vision["image_size"]), int(vision["patch_size"]), int(vision["width"])
        self.grid = size // patch
        self.patch_embed = _PatchEmbed(patch, width)
        self.pos_embed = nn.Parameter(torch.randn(1, self.grid * self.grid, width) * 0.02)
        hidden = int(width * float(vision["mlp_ratio"]))
        heads, depth = int(vision["heads"]), int(vision["layers"])
        self.blocks = nn.Sequential(*[_Block(width, heads, hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=1e-6)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.norm(self.blocks(self.patch_embed(pixels) + self.pos_embed))


class Projector(nn.Module):
    """DeepSeek-VL2's ``downsample_mlp_gelu`` adaptor: r x r patch concat (pad odd grids), then ``depth`` Linears
    with GELU between them (``layers.0``, ``layers.2``, ...: the official Sequential's indices)."""

    def __init__(self, input_dim: int, n_embed: int, depth: int = 2, mlp_ratio: int = 1, downsample: int = 2) -> None:
        super().__init__()
        self.downsample = downsample
        width = n_embed * mlp_ratio
        mods: list[nn.Module] = [nn.Linear(input_dim * downsample * downsample, width)]
        for _ in range(1, depth - 1):
            mods += [nn.GELU(), nn.Linear(width, width)]
        mods += [nn.GELU(), nn.Linear(width, n_embed)]
        self.layers = nn.Sequential(*mods)

    def forward(self, x: Tensor) -> Tensor:
        b, p, c = x.shape
        side = math.isqrt(p)
        if side * side != p:
            raise DeepseekVL2Error(f"vision features of {p} patches are not a square grid")
        x = x.reshape(b, side, side, c)
        pad = (-side) % self.downsample
        if pad:
            x = F.pad(x, (0, 0, 0, pad, 0, pad))
        x = F.unfold(x.permute(0, 3, 1, 2), kernel_size=self.downsample, stride=self.downsample)
        return self.layers(x.permute(0, 2, 1))


# ------------------------------------------------------------------------------------------ language
class Router(dsv2.DeepseekV2TopkRouter):
    """The official ``MoEGate`` at inference, as transformers' router interface: (float32 logits, weights, experts).

    Selection is :func:`~specprefetch.models.routing.select_experts` (masked groups filled with 0.0, as the
    official gate does); the weights are the chosen experts' scores, renormalised when ``norm_topk_prob`` (and
    K > 1), times ``routed_scaling_factor``.
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__(config)
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = bool(config.norm_topk_prob)
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(x.float(), self.weight.float())
        bias = getattr(self, "e_score_correction_bias", None)
        experts = select_experts(logits, self.top_k, self.scoring_func, self.topk_method, self.num_group,
                                 self.topk_group, None if bias is None else bias.detach().float(), group_fill=0.0)
        weights = router_scores(logits, self.scoring_func).gather(1, experts)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, experts


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class MultiHeadAttention(nn.Module):
    """Multi-head attention of ``use_mla: false`` (DeepSeek-VL2-Tiny): ``q/k/v/o_proj`` with half-split RoPE, as
    transformers 4's ``LlamaAttention`` that the official code runs. transformers' DeepSeek-V2 rotary module gives
    the rotation as ``cos + i sin`` per frequency; half-split RoPE applies it to ``(x_j, x_{j + d/2})`` pairs."""

    def __init__(self, config: DeepseekV2Config, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, cache: Any = None,
                position_embeddings: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        b, s, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        freqs = position_embeddings.unsqueeze(1)
        cos = torch.cat([freqs.real, freqs.real], dim=-1).to(q.dtype)
        sin = torch.cat([freqs.imag, freqs.imag], dim=-1).to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = dsv2.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                             dsv2.eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                              self.attention_dropout, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, s, -1).contiguous()), weights


class DecoderLayer(dsv2.DeepseekV2DecoderLayer):
    """A DeepSeek-V2 layer as the official code builds it: MHA or MLA; MoE iff ``idx >= first_k_dense_replace``
    and ``idx % moe_layer_freq == 0`` (transformers' forward, unchanged)."""

    def __init__(self, config: DeepseekV2Config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = (dsv2.DeepseekV2Attention(config, layer_idx) if config.use_mla
                          else MultiHeadAttention(config, layer_idx))
        if is_moe_layer(config, layer_idx):
            self.mlp = dsv2.DeepseekV2Moe(config)
            self.mlp.gate = Router(config)
            if not config.has_shared_experts:
                self.mlp.shared_experts = _Zero()
        else:
            self.mlp = dsv2.DeepseekV2MLP(config)
        self.input_layernorm = dsv2.DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = dsv2.DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class _Zero(nn.Module):
    """No shared experts (``n_shared_experts: null``): adds nothing. ``DeepseekV2Moe.forward`` adds
    ``shared_experts(residuals)`` to the routed output; a 0-dim zero of the input's dtype broadcasts there (and does
    not change the sum's dtype), so nothing of the input's size is allocated. The sum is the one ``zeros_like``
    gave, bit for bit (``x + 0`` turns -0.0 into +0.0 in both)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(())


def is_moe_layer(config: DeepseekV2Config, idx: int) -> bool:
    return idx >= int(config.first_k_dense_replace or 0) and idx % int(getattr(config, "moe_layer_freq", 1)) == 0


class TextModel(dsv2.DeepseekV2Model):
    def __init__(self, config: DeepseekV2Config) -> None:
        dsv2.DeepseekV2PreTrainedModel.__init__(self, config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = dsv2.DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = dsv2.DeepseekV2RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class LanguageModel(dsv2.DeepseekV2ForCausalLM):
    """transformers' ``DeepseekV2ForCausalLM`` over :class:`TextModel` (generation, caching, attention backends)."""

    def __init__(self, config: DeepseekV2Config) -> None:
        dsv2.DeepseekV2PreTrainedModel.__init__(self, config)
        self.model = TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


# ------------------------------------------------------------------------------------------ the model
class DeepseekVL2ForCausalLM(nn.Module):
    """Vision tower + projector + tile tags + DeepSeek-V2 language model, wired as the official model wires them.

    ``forward``/``generate`` take the processor's tensors: ``input_ids [B, T]``, ``images [B, tiles, 3, S, S]``,
    ``images_seq_mask [B, T]``, ``images_spatial_crop [B, n_images, 2]`` (width tiles, height tiles; 0 0 ends).
    """

    def __init__(self, config: DeepseekVL2Config) -> None:
        super().__init__()
        self.config = config
        p = config.projector
        self.vision = SiglipViT(config.vision)
        self.projector = Projector(int(p["input_dim"]), int(p["n_embed"]), int(p["depth"]), int(p["mlp_ratio"]),
                                   int(p["downsample_ratio"]))
        std = 1 / math.sqrt(int(p["n_embed"]))
        self.image_newline = nn.Parameter(torch.randn(int(p["n_embed"])) * std)
        self.view_seperator = nn.Parameter(torch.randn(int(p["n_embed"])) * std)  # sic: the checkpoint's name
        self.language = LanguageModel(config.text)

    @property
    def device(self) -> torch.device:
        return self.image_newline.device

    @property
    def dtype(self) -> torch.dtype:
        return self.image_newline.dtype

    @property
    def generation_config(self) -> Any:
        return self.language.generation_config

    def get_input_embeddings(self) -> nn.Module:
        return self.language.get_input_embeddings()

    def image_tokens(self, tiles: Tensor, spatial_crop: Iterable[tuple[int, int]]) -> Tensor:
        """The embeddings that fill one sample's ``<image>`` positions: ``tiles`` are its global + local views."""
        feats = self.projector(self.vision(tiles.to(self.vision.pos_embed.dtype)))
        n, hw, d = feats.shape
        h = w = math.isqrt(hw)
        out, t = [], 0
        for tw, th in spatial_crop:
            glob = torch.cat([feats[t].view(h, w, d), self.image_newline.expand(h, 1, d)], dim=1).reshape(-1, d)
            local = feats[t + 1:t + 1 + tw * th].view(th, tw, h, w, d).permute(0, 2, 1, 3, 4).reshape(th * h, tw * w, d)
            local = torch.cat([local, self.image_newline.expand(th * h, 1, d)], dim=1).reshape(-1, d)
            sep = self.view_seperator[None]
            out.append(torch.cat([glob, sep, local] if self.config.global_view_pos == "head" else [local, sep, glob]))
            t += 1 + tw * th
        if t > n:
            raise DeepseekVL2Error(f"images_spatial_crop asks for {t} tiles, images holds {n}")
        return torch.cat(out) if out else feats.new_zeros(0, d)

    def prepare_inputs_embeds(self, input_ids: Tensor, images: Tensor | None = None,
                              images_seq_mask: Tensor | None = None, images_spatial_crop: Tensor | None = None,
                              **_: Any) -> Tensor:
        embeds = self.language.get_input_embeddings()(input_ids)
        if images is None or images_spatial_crop is None or int(images_spatial_crop.sum()) == 0:
            return embeds
        for b in range(input_ids.shape[0]):
            crops = [(int(tw), int(th)) for tw, th in images_spatial_crop[b].tolist()]
            crops = crops[:next((i for i, (tw, th) in enumerate(crops) if tw == 0 or th == 0), len(crops))]
            if not crops:
                continue
            n_tiles = sum(1 + tw * th for tw, th in crops)
            feats = self.image_tokens(images[b, :n_tiles], crops).to(embeds.dtype)
            mask = images_seq_mask[b].bool()
            if int(mask.sum()) != feats.shape[0]:
                raise DeepseekVL2Error(f"sample {b}: {int(mask.sum())} <image> positions but {feats.shape[0]} image "
                                       f"tokens for images_spatial_crop {crops}")
            embeds[b] = embeds[b].masked_scatter(mask.unsqueeze(-1), feats)
        return embeds

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, images: Tensor | None = None,
                images_seq_mask: Tensor | None = None, images_spatial_crop: Tensor | None = None,
                **kwargs: Any) -> Any:
        embeds = self.prepare_inputs_embeds(input_ids, images, images_seq_mask, images_spatial_crop)
        return self.language(inputs_embeds=embeds, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, images: Tensor | None = None,
                 images_seq_mask: Tensor | None = None, images_spatial_crop: Tensor | None = None,
                 **kwargs: Any) -> Any:
        """Generation from the merged embeddings; returns the prompt ids followed by the new ids (as transformers)."""
        embeds = self.prepare_inputs_embeds(input_ids, images, images_seq_mask, images_spatial_crop)
        return self.language.generate(input_ids=input_ids, inputs_embeds=embeds, attention_mask=attention_mask,
                                      **kwargs)


# ------------------------------------------------------------------------------------------ weights
def _expert_key(name: str) -> tuple[str, int, str] | None:
    """``language.model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` -> (layer prefix, E, proj)."""
    parts = name.split(".")
    if len(parts) == 9 and parts[:3] == ["language", "model", "layers"] and parts[4:6] == ["mlp", "experts"] \
            and parts[6].isdigit() and parts[7] in ("gate_proj", "up_proj", "down_proj") and parts[8] == "weight":
        return ".".join(parts[:6]), int(parts[6]), parts[7]
    return None


def from_official_state_dict(tensors: Mapping[str, Tensor], n_experts: int) -> dict[str, Tensor]:
    """The official checkpoint's tensors with each layer's routed experts stacked into the fused
    ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj [E, H, I]``; the
    never-run attention-pool head dropped."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, t in tensors.items():
        if name.startswith(UNUSED_PREFIXES):
            continue
        key = _expert_key(name)
        if key is None:
            out[name] = t
        else:
            prefix, e, proj = key
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
    for prefix, projs in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = projs.get(proj, {})
            missing = sorted(set(range(n_experts)) - set(have))
            if missing or len(have) != n_experts:
                raise DeepseekVL2Error(f"checkpoint: {prefix}.*.{proj}.weight misses experts {missing[:8]} "
                                       f"(has {len(have)} of {n_experts})")
        gate, up, down = ([projs[p][e] for e in range(n_experts)] for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{prefix}.down_proj"] = torch.stack(down)
    return out


def to_official_state_dict(model: DeepseekVL2ForCausalLM) -> dict[str, Tensor]:
    """The inverse of :func:`from_official_state_dict`: per-expert tensors under the official names."""
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    if model.config.text.tie_word_embeddings:
        out.pop("language.lm_head.weight", None)
    return out


def _read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint: the files ``model.safetensors.index.json`` names (else every
    ``*.safetensors``), each read by ``contracts.load_safetensors``; a tensor in two files is an error."""
    index = directory / "model.safetensors.index.json"
    with reraise_as(DeepseekVL2Error):
        if index.is_file():
            doc = read_doc(index, None, "safetensors index", required=("weight_map",))
            weight_map = require(doc, "weight_map", dict, str(index))
            files = sorted({member(directory, name, f"{index.name} weight_map") for name in weight_map.values()})
            what = f"DeepSeek-VL2 weights (listed in {index.name})"
        else:
            files = sorted(directory.glob("*.safetensors"))
            what = "DeepSeek-VL2 weights"
        if not files:
            raise DeepseekVL2Error(f"{directory}: no safetensors weights")
        tensors: dict[str, Tensor] = {}
        source: dict[str, Path] = {}
        for path in files:
            for name, t in load_safetensors(path, what).items():
                if name in source:
                    raise DeepseekVL2Error(f"{path}: tensor {name} is also in {source[name].name}")
                tensors[name], source[name] = t, path
    return tensors


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> DeepseekVL2ForCausalLM:
    """Build the model from ``directory``'s config.json on the meta device and fill it from its safetensors:
    every parameter exactly once, with its shape; an unknown or missing tensor is named."""
    directory = Path(directory)
    config = DeepseekVL2Config.from_pretrained(str(directory))
    with torch.device("meta"):
        model = DeepseekVL2ForCausalLM(config)
    state = from_official_state_dict(_read_safetensors(directory), int(config.text.n_routed_experts))
    if config.text.tie_word_embeddings:
        state.setdefault("language.lm_head.weight", state.get("language.model.embed_tokens.weight"))
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise DeepseekVL2Error(f"{directory}: checkpoint does not match config.json: missing {missing[:6]}"
                               f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                               f"{' ...' if len(unexpected) > 6 else ''}")
    for name, t in want.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise DeepseekVL2Error(f"{directory}: tensor {name} has shape {tuple(state[name].shape)}, config.json "
                                   f"implies {tuple(t.shape)}")
    keep_fp32 = {n for n in want if n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}
    model.load_state_dict({n: t.to(device=device, dtype=torch.float32 if n in keep_fp32 else dtype)
                           for n, t in state.items()}, strict=True, assign=True)
    # The RoPE frequencies are a non-persistent buffer, built on the meta device above: build them for real.
    model.language.model.rotary_emb = dsv2.DeepseekV2RotaryEmbedding(config=config.text).to(device)
    return model.eval()


def save_official(model: DeepseekVL2ForCausalLM, directory: str | Path) -> None:
    """Write ``model`` as an official checkpoint: config.json (the official keys) + model.safetensors."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(directory))
    save_file(to_official_state_dict(model), str(directory / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ processor
def select_best_resolution(image_size: tuple[int, int], candidates: Iterable[Iterable[int]]) -> tuple[int, int]:
    """The candidate (width, height) that keeps the most of the image's resolution, then wastes the least."""
    ow, oh = image_size
    best, best_eff, best_waste = None, 0, float("inf")
    for width, height in candidates:
        scale = min(width / ow, height / oh)
        eff = min(int(ow * scale) * int(oh * scale), ow * oh)
        waste = width * height - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(width), int(height)), eff, waste
    if best is None:
        raise DeepseekVL2Error("candidate_resolutions is empty")
    return best


class DeepseekVL2Processor:
    """The official ``DeepseekVLV2Processor`` for one conversation turn: "deepseek" chat format and tiling."""

    CHAT_TOKENS = ("<|User|>", "<|Assistant|>")
    GROUNDING_TOKENS = ("<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>")

    def __init__(self, tokenizer: Any, candidate_resolutions: list[list[int]], patch_size: int, downsample_ratio: int,
                 image_mean: tuple[float, ...] = (0.5, 0.5, 0.5), image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
                 normalize: bool = True, image_token: str = "<image>", pad_token: str = "<｜▁pad▁｜>",
                 **_: Any) -> None:
        self.candidate_resolutions = [tuple(int(v) for v in c) for c in candidate_resolutions]
        self.image_size = self.candidate_resolutions[0][0]
        self.patch_size, self.downsample_ratio = int(patch_size), int(downsample_ratio)
        self.image_mean, self.image_std, self.normalize = tuple(image_mean), tuple(image_std), bool(normalize)
        self.tokenizer = tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.add_special_tokens({"pad_token": pad_token})
        # As the official processor: each group is added as additional special tokens (existing ones keep ids).
        for group in ((image_token,), self.GROUNDING_TOKENS, self.CHAT_TOKENS):
            missing = [t for t in group if t not in tokenizer.get_vocab()]
            if missing or group != (image_token,):
                tokenizer.add_special_tokens({"additional_special_tokens": list(group)})
        self.image_token = image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepseekVL2Processor:
        from transformers import AutoTokenizer

        directory = Path(directory)
        path = directory / PROCESSOR_CONFIG
        try:
            params = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DeepseekVL2Error(f"{path}: cannot read the processor config ({exc})") from None
        return cls(AutoTokenizer.from_pretrained(str(directory)), **params)

    def tokens_per_image(self, width_tiles: int, height_tiles: int) -> int:
        h = w = math.ceil((self.image_size // self.patch_size) / self.downsample_ratio)
        return h * (w + 1) + 1 + (height_tiles * h) * (width_tiles * w + 1)

    def _pixels(self, image: Any) -> Tensor:
        import numpy as np

        x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
        if self.normalize:
            x = (x - torch.tensor(self.image_mean).view(3, 1, 1)) / torch.tensor(self.image_std).view(3, 1, 1)
        return x

    def _tiles(self, image: Any, cropping: bool) -> tuple[list[Tensor], tuple[int, int]]:
        from PIL import ImageOps

        fill = tuple(int(m * 255) for m in self.image_mean)
        s = self.image_size
        bw, bh = select_best_resolution(image.size, self.candidate_resolutions) if cropping else (s, s)
        tiles = [self._pixels(ImageOps.pad(image, (s, s), color=fill))]
        local = ImageOps.pad(image, (bw, bh), color=fill)
        tiles += [self._pixels(local.crop((j, i, j + s, i + s))) for i in range(0, bh, s) for j in range(0, bw, s)]
        return tiles, (bw // s, bh // s)

    def prompt(self, text: str) -> str:
        """The "deepseek" format of one user turn awaiting the answer (system prompt empty)."""
        return f"{self.CHAT_TOKENS[0]}: {text.strip()}\n\n{self.CHAT_TOKENS[1]}:"

    def __call__(self, text: str, images: list[Any] | None = None) -> dict[str, Any]:
        """Batch-of-1 tensors for a user turn ``text`` (``<image>`` marks each image's place): ``input_ids``,
        ``attention_mask``, ``images``, ``images_seq_mask``, ``images_spatial_crop``, and ``sft_format``."""
        images = list(images or [])
        sft = self.prompt(text)
        splits = sft.split(self.image_token)
        if len(splits) - 1 != len(images):
            raise DeepseekVL2Error(f"{len(splits) - 1} {self.image_token} tags in the prompt but {len(images)} images")
        ids: list[int] = [self.tokenizer.bos_token_id]
        mask: list[bool] = [False]
        tiles: list[Tensor] = []
        crops: list[list[int]] = []
        for part, image in zip(splits, images):
            enc = self.tokenizer.encode(part, add_special_tokens=False)
            ids += enc
            mask += [False] * len(enc)
            t, (tw, th) = self._tiles(image, cropping=len(images) <= 2)
            tiles += t
            crops.append([tw, th])
            n = self.tokens_per_image(tw, th)
            ids += [self.image_token_id] * n
            mask += [True] * n
        enc = self.tokenizer.encode(splits[-1], add_special_tokens=False)
        ids += enc
        mask += [False] * len(enc)
        s = self.image_size
        pixels = torch.stack(tiles) if tiles else torch.zeros(1, 3, s, s)
        spatial = torch.tensor(crops, dtype=torch.long) if crops else torch.zeros(1, 2, dtype=torch.long)
        input_ids = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "images": pixels.unsqueeze(0), "images_seq_mask": torch.tensor([mask]),
                "images_spatial_crop": spatial.unsqueeze(0), "sft_format": sft}
