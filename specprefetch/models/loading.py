"""Load a model of the config (stand-in, local copy or hub checkpoint) and encode samples for it.

``load_bundle`` returns a :class:`ModelBundle`: the model in eval mode, its tokenizer and image processing, and
its :class:`RoutingSpec`, checked against the config entry (n_experts, top_k, hidden_size, MoE layer count,
shared experts) so a wrong checkpoint fails naming the key. ``encode_sample`` builds the teacher-forced
sequence ``[image] prompt reference`` with per-token masks, as every later stage (traces, runtime) consumes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.config import REPO_ROOT, ConfigError, n_moe_layers
from specprefetch.io import SpecPrefetchError
from specprefetch.models.routing import RoutingSpec, discover_routing
from specprefetch.models.standins import (
    META_FILE,
    DeepseekVL2StandIn,
    check_checkpoint_config,
    check_weights_match_config,
    load_stand_in,
)

log = logging.getLogger(__name__)

TEXT_ONLY_ARCHS = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral", "olmoe")
PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "images_seq_mask")


class ModelLoadError(SpecPrefetchError):
    """A model cannot be loaded (missing directory, unreachable hub, bad checkpoint); the message says which."""


@dataclass
class ModelBundle:
    """Everything a stage needs to run a model: see the shared data contract.

    ``kind`` is how it was loaded ("stand_in" or "hf"); ``processor`` is the hub processor (Qwen3-VL's
    AutoProcessor, DeepSeek-VL2's DeepseekVLV2Processor) when there is one; ``meta`` holds the stand-in's
    ``specprefetch_model.json``.
    """

    name: str
    arch: str
    kind: str
    model: nn.Module
    tokenizer: Any
    image_processor: Any
    routing: RoutingSpec
    model_cfg: dict[str, Any]
    model_dir: Path | None = None
    processor: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def spec(self) -> RoutingSpec:
        return self.routing

    @property
    def max_length(self) -> int:
        return int(self.model_cfg["max_length"])


@dataclass
class EncodedSample:
    """One sample ready for a forward: ``kwargs`` (batch of 1) and per-token masks of shape ``[S]``.

    ``is_prompt``: the prefill part (chat markers, image, prompt); the reference (teacher-forced answer) is
    the decode part. ``is_image``: image placeholder tokens. ``valid``: not padding.
    """

    sample_id: str
    kwargs: dict[str, Tensor]
    input_ids: Tensor
    is_prompt: Tensor
    is_image: Tensor
    valid: Tensor
    truncated: bool = False

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: str | torch.device) -> EncodedSample:
        return replace(self, kwargs={k: v.to(device) for k, v in self.kwargs.items()})


# ------------------------------------------------------------------------------------------ loading
def load_bundle(cfg: dict[str, Any], model_name: str, model_dir: str | Path | None = None,
                device: str | torch.device = "cpu") -> ModelBundle:
    """Load ``cfg["models"][model_name]`` from ``model_dir`` (a stand-in or local checkpoint) or the hub."""
    models = cfg.get("models", {})
    if model_name not in models:
        raise ConfigError(f"unknown model {model_name!r}; config models: {', '.join(models) or '(none)'}")
    mcfg = models[model_name]
    device = torch.device(device)
    source = mcfg["source"]
    local = Path(model_dir) if model_dir is not None else _config_path(mcfg.get("path"))
    if source == "stand_in" and local is None:
        raise ModelLoadError(f"model {model_name!r} is a stand-in: pass its directory (made by "
                             "`specprefetch pretrain-stand-in`)")
    if local is not None and not local.is_dir():
        raise ModelLoadError(f"model directory not found: {local} (model {model_name!r})")
    if local is not None and (local / META_FILE).is_file():
        bundle = _load_stand_in_bundle(model_name, mcfg, local, device)
    elif source == "stand_in":
        raise ModelLoadError(f"{local}: no {META_FILE}; not a stand-in directory (model {model_name!r})")
    else:
        bundle = _load_hf_bundle(model_name, mcfg, local, device)
    check_routing_matches(bundle.routing, mcfg, model_name)
    log.info("loaded %s (%s, %s): %d MoE layers, n=%d, K=%d, D=%d", model_name, bundle.arch, bundle.kind,
             bundle.routing.n_layers, bundle.routing.n_experts, bundle.routing.top_k, bundle.routing.hidden_size)
    return bundle


def _config_path(value: str | None) -> Path | None:
    """A config ``path:``; relative paths are relative to the repository root (as the config validator does)."""
    if not value:
        return None
    p = Path(value).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def check_routing_matches(spec: RoutingSpec, mcfg: dict[str, Any], model_name: str) -> None:
    """The discovered routing must match the config entry; a mismatch names the key."""
    key = f"models.{model_name}"
    if spec.arch != mcfg["arch"]:
        raise ConfigError(f"invalid config key '{key}.arch': the model is {spec.arch!r}, config says {mcfg['arch']!r}")
    checks = [
        ("n_experts", spec.n_experts, int(mcfg["n_experts"])),
        ("top_k", spec.top_k, int(mcfg["top_k"])),
        ("hidden_size", spec.hidden_size, int(mcfg["hidden_size"])),
        ("num_hidden_layers", spec.num_hidden_layers, int(mcfg["num_hidden_layers"])),
        ("first_dense_layers", spec.n_layers, n_moe_layers(mcfg)),
        ("n_shared_experts", spec.n_shared_experts, int(mcfg["n_shared_experts"])),
    ]
    for name, found, want in checks:
        if found != want:
            what = "MoE layers" if name == "first_dense_layers" else name
            raise ConfigError(f"invalid config key '{key}.{name}': the model has {what}={found}, "
                              f"the config implies {want}")


def _load_stand_in_bundle(name: str, mcfg: dict[str, Any], path: Path, device: torch.device) -> ModelBundle:
    s = load_stand_in(path, device, mcfg=mcfg, model_name=name)
    spec = discover_routing(s.model)
    return ModelBundle(name=name, arch=spec.arch, kind="stand_in", model=s.model, tokenizer=s.tokenizer,
                       image_processor=s.image_processor, routing=spec, model_cfg=mcfg, model_dir=path,
                       meta=s.meta, device=device)


def _dtype(mcfg: dict[str, Any]) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        mcfg["torch_dtype"]]


def _hub_error(mcfg: dict[str, Any], name: str, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"cannot load {mcfg.get('hub_id')!r} (revision {mcfg.get('revision', 'main')!r}) for model {name!r}: "
        f"{type(exc).__name__}: {exc}. If the Hugging Face hub is unreachable, download the checkpoint elsewhere "
        f"(e.g. `hf download {mcfg.get('hub_id')} --revision {mcfg.get('revision', 'main')} --local-dir DIR`) "
        f"and set `models.{name}.path: DIR` in the config (or pass --model-dir DIR)"
    )


def _local_error(local: Path, name: str, exc: BaseException) -> ModelLoadError:
    first = (str(exc).strip().splitlines() or [""])[0]
    if "ignore_mismatched_sizes" in first:
        return ModelLoadError(f"{local}: tensor shapes of the weights do not match {local / 'config.json'} (the "
                              f"weights and config.json are from different models; model {name!r})")
    return ModelLoadError(f"{local}: cannot load the checkpoint of model {name!r}: {type(exc).__name__}: {first}")


def check_local_checkpoint(local: Path, mcfg: dict[str, Any], name: str) -> None:
    """Before ``from_pretrained`` reads a local checkpoint: its config.json agrees with the config's model entry,
    its safetensors files are whole (a truncated one is named), the shards its index lists exist, and the router
    gates' shapes agree with config.json. (A directory with ``specprefetch_model.json`` is a stand-in, loaded by
    :func:`load_stand_in`, which also checks the sha256 recorded there.)"""
    config_json = local / "config.json"
    if not config_json.is_file():
        raise ModelLoadError(f"{config_json}: missing; {local} is not a transformers checkpoint (model {name!r})")
    check_checkpoint_config(config_json, mcfg, name)
    check_weights_match_config(local, config_json)


def _load_hf_bundle(name: str, mcfg: dict[str, Any], local: Path | None, device: torch.device) -> ModelBundle:
    """A transformers checkpoint (hub id or local copy); DeepSeek-VL2 in the official layout, by our own classes."""
    from safetensors import SafetensorError

    arch = mcfg["arch"]
    where = str(local) if local is not None else mcfg.get("hub_id")
    if where is None:
        raise ConfigError(f"invalid config key 'models.{name}.hub_id': required to load source {mcfg['source']!r}")
    if local is not None:
        check_local_checkpoint(local, mcfg, name)
    common: dict[str, Any] = {"dtype": _dtype(mcfg)}
    if local is None:
        common["revision"] = mcfg["revision"]
    if mcfg.get("device_map"):
        common["device_map"] = mcfg["device_map"]
    processor = None
    try:
        if arch == "qwen3_vl_moe":
            from transformers import AutoProcessor, Qwen3VLMoeForConditionalGeneration

            model = Qwen3VLMoeForConditionalGeneration.from_pretrained(where, **common)
            processor = _qwen3_vl_processor(where, common.get("revision"), AutoProcessor)
            tokenizer, image_processor = processor.tokenizer, processor.image_processor
        elif arch == "deepseek_vl2":
            model, processor = _load_deepseek_vl2(name, mcfg, local, common)
            tokenizer, image_processor = processor.tokenizer, processor
        elif arch in TEXT_ONLY_ARCHS:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(where, **common)
            tokenizer, image_processor = AutoTokenizer.from_pretrained(where, revision=common.get("revision")), None
        else:
            raise ConfigError(f"invalid config key 'models.{name}.arch': {arch!r} cannot be loaded from a checkpoint")
    except (OSError, ValueError, ImportError, RuntimeError, SafetensorError) as exc:
        if isinstance(exc, SpecPrefetchError):
            raise
        if local is not None:
            raise _local_error(local, name, exc) from exc
        if isinstance(exc, RuntimeError):
            raise
        raise _hub_error(mcfg, name, exc) from exc
    if "device_map" not in common or arch == "deepseek_vl2":
        model.to(device)
    model.eval()
    spec = discover_routing(model)
    return ModelBundle(name=name, arch=spec.arch, kind="hf", model=model, tokenizer=tokenizer,
                       image_processor=image_processor, routing=spec, model_cfg=mcfg, model_dir=local,
                       processor=processor, device=device)


class QwenImageTextProcessor:
    """Qwen3-VL's processor for text and images, for installs without torchvision.

    transformers' ``Qwen3VLProcessor`` cannot be built without torchvision (its video processor needs it), and
    torchvision's wheels are CUDA builds that do not load with a CPU torch. This does what that processor does for
    images and text: the checkpoint's chat template, the image processor (its PIL backend, with the checkpoint's
    ``preprocessor_config.json``), each ``<|image_pad|>`` expanded to ``prod(image_grid_thw) / merge_size^2``
    tokens, and ``mm_token_type_ids`` (1 on image tokens). Resizing is PIL's instead of torchvision's, so pixel
    values can differ in the last bits from a torchvision install; token counts and layout are the same.
    """

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text: list[str], images: list[Any] | None = None, return_tensors: str = "pt") -> dict[str, Any]:
        out: dict[str, Any] = {}
        text = list(text)
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt"))
            merge = int(self.image_processor.merge_size) ** 2
            counts = iter(int(g.prod()) // merge for g in out["image_grid_thw"])
            marker = "\0IMAGE\0"
            for i, t in enumerate(text):
                while self.image_token in t:
                    t = t.replace(self.image_token, marker * next(counts), 1)
                text[i] = t.replace(marker, self.image_token)
        enc = self.tokenizer(text, return_tensors=return_tensors, add_special_tokens=False)
        out.update(enc)
        out["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).to(torch.int32)
        return out


def _qwen3_vl_processor(where: str, revision: str | None, auto_processor: Any) -> Any:
    """transformers' own processor; without torchvision, :class:`QwenImageTextProcessor` (logged once)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return auto_processor.from_pretrained(where, revision=revision)
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    log.warning("torchvision is not installed: Qwen3-VL's images are processed by its PIL image processor "
                "(specprefetch.models.loading.QwenImageTextProcessor) instead of transformers' Qwen3VLProcessor")
    return QwenImageTextProcessor(AutoTokenizer.from_pretrained(where, revision=revision),
                                  Qwen2VLImageProcessorPil.from_pretrained(where, revision=revision))


def _load_deepseek_vl2(name: str, mcfg: dict[str, Any], local: Path | None, common: dict[str, Any]) -> tuple[Any, Any]:
    """DeepSeek-VL2 through our native implementation (:mod:`specprefetch.models.deepseek_vl2`): a local
    checkpoint directory, or the hub snapshot of ``hub_id`` at ``revision`` (the Hugging Face cache; with
    ``HF_HUB_OFFLINE=1`` only the cache)."""
    from specprefetch.models.deepseek_vl2 import DeepseekVL2Processor, load_model

    directory = local
    if directory is None:
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(mcfg["hub_id"], revision=mcfg["revision"],
                                           allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    model = load_model(directory, dtype=common["dtype"],
                       device="cpu" if common.get("device_map") in (None, "cpu") else _cuda_or_cpu())
    return model, DeepseekVL2Processor.from_pretrained(directory)


def _cuda_or_cpu() -> str:
    """``device_map`` (e.g. ``auto``) for DeepSeek-VL2: the whole model on the first GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------ encoding
def _field(sample: Any, key: str) -> Any:
    return sample[key] if isinstance(sample, dict) else getattr(sample, key)


def load_image(sample: Any, root: str | Path) -> Any:
    """The sample's image as an RGB PIL image (None for text-only samples); a missing file names the path."""
    from PIL import Image

    from specprefetch.contracts import check_pixel_budget

    rel = _field(sample, "image")
    if rel is None:
        return None
    path = Path(root) / rel
    if not path.is_file():
        raise SpecPrefetchError(f"image file not found: {path} (sample {_field(sample, 'id')!r})")
    try:
        with Image.open(path) as img:
            check_pixel_budget(img.size, f"{path} (sample {_field(sample, 'id')!r})")  # before decoding
            return img.convert("RGB")
    except (OSError, Image.DecompressionBombError) as exc:
        raise SpecPrefetchError(f"cannot read image {path}: {exc}") from None


def encode_sample(bundle: ModelBundle, sample: Any, root: str | Path, max_length: int | None = None) -> EncodedSample:
    """Teacher-forced encoding of ``[image] prompt reference`` for ``bundle``'s model (see module docstring).

    The image goes before the prompt; truncation to ``max_length`` (default the config's) cuts the end and
    never an image token (an image that does not fit raises).
    """
    max_length = int(max_length or bundle.max_length)
    image = load_image(sample, root) if bundle.arch not in TEXT_ONLY_ARCHS else None
    if bundle.kind == "stand_in":
        return _encode_stand_in(bundle, sample, image, max_length)
    if bundle.arch == "qwen3_vl_moe":
        return _encode_qwen_hub(bundle, sample, image, max_length)
    if bundle.arch == "deepseek_vl2":
        return _encode_deepseek_vl2_hub(bundle, sample, image, max_length)
    return _encode_text_hub(bundle, sample, max_length)


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _finish(sample: Any, kwargs: dict[str, Tensor], n_prompt: int, image_mask: Tensor, max_length: int,
            n_image_tokens: int) -> EncodedSample:
    """Truncate per-token tensors to ``max_length`` (keeping every image token) and build the masks."""
    ids = kwargs["input_ids"][0]
    s = ids.shape[0]
    truncated = s > max_length
    if truncated:
        last_image = int(image_mask.nonzero().max()) + 1 if image_mask.any() else 0
        if last_image >= max_length:
            raise SpecPrefetchError(
                f"sample {_field(sample, 'id')!r}: its {n_image_tokens} image tokens end at position {last_image}, "
                f"beyond max_length={max_length}; raise models.*.max_length"
            )
        for k in PER_TOKEN_KEYS:
            if k in kwargs:
                kwargs[k] = kwargs[k][:, :max_length]
        image_mask = image_mask[:max_length]
        ids = kwargs["input_ids"][0]
        s = max_length
    pos = torch.arange(s)
    return EncodedSample(
        sample_id=str(_field(sample, "id")), kwargs=kwargs, input_ids=ids, is_prompt=pos < n_prompt,
        is_image=image_mask.bool(), valid=kwargs["attention_mask"][0].bool(), truncated=truncated,
    )


def stand_in_sequence(tokenizer: Any, meta: dict[str, Any], sample: Any, n_image: int) -> tuple[list[int], int]:
    """Token ids of a stand-in sample and its prompt length: ``<|im_start|> [image] prompt <|im_end|> reference
    <|endoftext|>``; the image block is ``<|vision_start|> <|image_pad|>*n <|vision_end|>`` (Qwen3-VL) or
    ``<image>*n`` (DeepSeek-VL2), absent when ``n_image == 0``."""
    ids_of = meta["special_token_ids"]
    image_block: list[int] = []
    if n_image:
        pad = [ids_of[meta["image_token"]]] * n_image
        image_block = ([ids_of["<|vision_start|>"], *pad, ids_of["<|vision_end|>"]] if meta["arch"] == "qwen3_vl_moe"
                       else pad)
    prompt = [ids_of["<|im_start|>"], *image_block, *_text_ids(tokenizer, _field(sample, "prompt")),
              ids_of["<|im_end|>"]]
    return prompt + _text_ids(tokenizer, _field(sample, "reference")) + [ids_of["<|endoftext|>"]], len(prompt)


def _encode_stand_in(bundle: ModelBundle, sample: Any, image: Any, max_length: int) -> EncodedSample:
    """See :func:`stand_in_sequence`; the prompt part is everything up to and including ``<|im_end|>``."""
    meta = bundle.meta
    kwargs: dict[str, Tensor] = {}
    n_img = 0
    if image is not None:
        out = bundle.image_processor(images=[image], return_tensors="pt")
        kwargs["pixel_values"] = out["pixel_values"]
        if bundle.arch == "qwen3_vl_moe":
            grid = out["image_grid_thw"]
            merge = int(meta["image"]["spatial_merge"])
            n_img = int(grid.prod()) // (merge * merge)
            kwargs["image_grid_thw"] = grid
        else:
            model = bundle.model
            if not isinstance(model, DeepseekVL2StandIn):
                raise SpecPrefetchError(f"{bundle.name}: deepseek_vl2_standin bundle without its stand-in model")
            n_img = model.n_image_tokens()
    seq, n_prompt = stand_in_sequence(bundle.tokenizer, meta, sample, n_img)
    input_ids = torch.tensor([seq], dtype=torch.long)
    image_mask = input_ids[0] == meta["special_token_ids"][meta["image_token"]]
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **kwargs}
    if bundle.arch == "qwen3_vl_moe":
        kwargs["mm_token_type_ids"] = image_mask.to(torch.int32).unsqueeze(0)
    return _finish(sample, kwargs, n_prompt, image_mask, max_length, n_img)


def _encode_qwen_hub(bundle: ModelBundle, sample: Any, image: Any, max_length: int) -> EncodedSample:
    """Qwen3-VL chat template (user turn: image then prompt; generation prompt), then the reference."""
    proc = bundle.processor
    content: list[dict[str, Any]] = ([{"type": "image"}] if image is not None else [])
    content.append({"type": "text", "text": _field(sample, "prompt")})
    prompt_text = proc.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    enc = proc(text=[prompt_text], images=[image] if image is not None else None, return_tensors="pt")
    n_prompt = int(enc["input_ids"].shape[1])
    ref = torch.tensor([_text_ids(proc.tokenizer, _field(sample, "reference") + "<|im_end|>")], dtype=torch.long)
    kwargs = {k: v for k, v in enc.items() if isinstance(v, Tensor)}
    kwargs["input_ids"] = torch.cat([enc["input_ids"], ref], dim=1)
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    mm = enc.get("mm_token_type_ids")
    mm = torch.zeros_like(enc["input_ids"], dtype=torch.int32) if mm is None else mm.to(torch.int32)
    kwargs["mm_token_type_ids"] = torch.cat([mm, torch.zeros_like(ref, dtype=torch.int32)], dim=1)
    image_mask = kwargs["input_ids"][0] == bundle.model.config.image_token_id
    return _finish(sample, kwargs, n_prompt, image_mask, max_length, int(image_mask.sum()))


def _encode_deepseek_vl2_hub(bundle: ModelBundle, sample: Any, image: Any, max_length: int) -> EncodedSample:
    """DeepSeek-VL2's chat format (``<|User|>: <image>\n{prompt}\n\n<|Assistant|>:``), then the reference and EOS."""
    proc = bundle.processor
    enc = proc(("<image>\n" if image is not None else "") + _field(sample, "prompt"),
               [image] if image is not None else [])
    tok = proc.tokenizer
    ref = torch.tensor([_text_ids(tok, _field(sample, "reference")) + [tok.eos_token_id]], dtype=torch.long)
    n_prompt = int(enc["input_ids"].shape[1])
    kwargs: dict[str, Tensor] = {
        "input_ids": torch.cat([enc["input_ids"], ref], dim=1),
        "images": enc["images"], "images_spatial_crop": enc["images_spatial_crop"],
        "images_seq_mask": torch.cat([enc["images_seq_mask"], torch.zeros_like(ref, dtype=torch.bool)], dim=1),
    }
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    image_mask = kwargs["images_seq_mask"][0].bool()
    return _finish(sample, kwargs, n_prompt, image_mask, max_length, int(image_mask.sum()))


def _encode_text_hub(bundle: ModelBundle, sample: Any, max_length: int) -> EncodedSample:
    """Text-only MoE LMs: the tokenizer's chat template when it has one, else prompt then reference."""
    tok = bundle.tokenizer
    prompt = _field(sample, "prompt")
    if getattr(tok, "chat_template", None):
        prompt_ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                  add_generation_prompt=True))
    else:
        prompt_ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + _text_ids(tok, prompt + "\n")
    ref_ids = _text_ids(tok, _field(sample, "reference")) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    input_ids = torch.tensor([prompt_ids + ref_ids], dtype=torch.long)
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    return _finish(sample, kwargs, len(prompt_ids), torch.zeros(input_ids.shape[1], dtype=torch.bool),
                   max_length, 0)


# ------------------------------------------------------------------------------------------ batching
def _pad_right(t: Tensor, length: int, fill: int) -> Tensor:
    """Pad ``[1, S]`` (any dtype, bool included) to ``[1, length]`` with ``fill``."""
    if t.shape[1] == length:
        return t
    pad = torch.full((t.shape[0], length - t.shape[1]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def collate_encoded(items: list[EncodedSample], pad_id: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Right-pad encoded samples into one batch: (forward kwargs, per-token masks ``[B, S]``).

    Per-token tensors are padded (``input_ids`` with ``pad_id``, masks with 0); image tensors (pixel values,
    grids) are concatenated along dim 0 in sample order, matching the placeholder order.
    """
    if not items:
        raise SpecPrefetchError("collate_encoded: empty batch")
    s = max(e.length for e in items)
    kwargs: dict[str, Tensor] = {}
    keys = list(dict.fromkeys(k for e in items for k in e.kwargs))
    for k in keys:
        parts = [e.kwargs[k] for e in items if k in e.kwargs]
        if k in PER_TOKEN_KEYS:
            fill = pad_id if k == "input_ids" else 0
            kwargs[k] = torch.cat([_pad_right(p, s, fill) for p in parts])
        else:
            kwargs[k] = torch.cat(parts, dim=0)
    masks = {}
    for name in ("is_prompt", "is_image", "valid"):
        masks[name] = torch.cat([_pad_right(getattr(e, name).unsqueeze(0), s, False) for e in items])
    return kwargs, masks
