"""Conformance fixture for DeepSeek-VL2: what the OFFICIAL DeepSeek-VL2 code computes on tiny random checkpoints.

    python scripts/deepseek_vl2_reference.py --out tests/golden/deepseek_vl2_reference [--venv /tmp/dsvl2-ref-venv]

One command. It (1) creates (or reuses) an isolated virtual environment with an old transformers the official code
imports with (4.47.1, else 4.46.3 / 4.45.2 / 4.38.2: the newest whose import + forward smoke test passes), the local
CPU ``torch==2.13.0``, torchvision, timm, einops, attrdict, sentencepiece and safetensors, and installs the official
package (``--official``, default ``/tmp/dsvl2``: a checkout of github.com/deepseek-ai/DeepSeek-VL2) into it with
``--no-deps``; (2) runs this same file inside that environment (``--worker``), which builds three tiny random models
with the official classes (``DeepseekVLV2Config``, ``DeepseekVLV2ForCausalLM``, ``DeepseekVLV2Processor``), saves
each in the official hub layout and records what the official code computes on fixed inputs.

Output (``--out``)::

    inputs/synthetic_3x2.png              the seeded synthetic image (240 x 160 px: 3 x 2 local tiles + global view)
    <variant>/checkpoint/                 config.json, model.safetensors, processor_config.json, tokenizer files
    <variant>/reference.safetensors       tensors (keys ``<case>.<what>``; see README.md next to it)
    <variant>/reference.json              versions (pip freeze), seeds, configs, sft_format strings, shapes, notes

for the variants ``tiny`` (MHA = transformers' LlamaAttention, greedy softmax routing), ``small`` (MLA,
group_limited_greedy softmax routing) and ``base`` (MLA, noaux_tc sigmoid routing with e_score_correction_bias).

Substitutions in the reference environment (the only ones):

- ``xformers`` cannot be installed on CPU. The official vision tower calls ``xformers.ops.memory_efficient_attention``
  (flash-attn is absent, so that branch is taken); a shim module ``xformers/ops.py`` in the environment computes
  exactly ``softmax(q k^T / sqrt(D)) v`` with torch (q, k, v in [B, N, H, D]).
- PyPI's torchvision wheels are CUDA builds whose compiled extension (``torchvision/_C.so``) cannot load against the
  CPU torch, and ``import torchvision`` then fails in ``torchvision/_meta_registrations.py``. The worker registers the
  installed ``torchvision`` package without executing its top-level ``__init__`` (which only loads that extension and
  eagerly imports datasets/models/ops); ``torchvision.transforms`` -- the only part the official processor uses
  (ToTensor, Normalize) -- is the installed, unmodified code.

The official code's own ``collections`` monkey-patch (modeling_deepseek_vl_v2.py, for Python >= 3.10) makes the
unmaintained ``attrdict`` importable; no attrdict shim is needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
DEFAULT_VENV = Path("/tmp/dsvl2-ref-venv")
DEFAULT_OFFICIAL = Path("/tmp/dsvl2")
TRANSFORMERS_CANDIDATES = ("4.47.1", "4.46.3", "4.45.2", "4.38.2")
# torch: the local CPU wheel (any other torch would pull a multi-GB CUDA build); torchvision: its matching release.
BASE_REQUIREMENTS = ("torch==2.13.0", "torchvision==0.28.0", "timm==1.0.12", "einops", "attrdict==2.0.1",
                     "sentencepiece", "safetensors")
READY_MARKER = ".dsvl2_reference_env.json"

XFORMERS_OPS = '''"""Shim for xformers.ops (written by scripts/deepseek_vl2_reference.py): xformers has no CPU build.

memory_efficient_attention(q, k, v) with q, k, v in [B, N, H, D] computes exactly softmax(q k^T / sqrt(D)) v
(no mask, no dropout), returned in [B, N, H, D] like xformers.
"""

import torch


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, **kwargs):
    if attn_bias is not None or p != 0.0 or kwargs:
        raise NotImplementedError("xformers shim: only attn_bias=None, p=0.0 (what DeepSeek-VL2 inference uses)")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, H, N, D]
    s = q.shape[-1] ** -0.5 if scale is None else scale
    attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * s, dim=-1)
    return torch.matmul(attn, v).transpose(1, 2)
'''


# ================================================================================================ driver
def log(msg: str) -> None:
    print(f"[dsvl2-ref {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], **kw)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    return env


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env())
    return Path(out.stdout.strip())


def pip_install(py: Path, *args: str) -> None:
    res = run([py, "-m", "pip", "install", "--disable-pip-version-check", *args], env=clean_env())
    if res.returncode != 0:
        raise SystemExit(f"pip install {' '.join(args)} failed (rc {res.returncode})")


def install_official(py: Path, official: Path) -> None:
    """pip install the official package with --no-deps, built from a copy in the environment (pip builds
    in-tree, and the checkout may be read-only)."""
    if not (official / "deepseek_vl2" / "models" / "modeling_deepseek_vl_v2.py").is_file():
        raise SystemExit(f"{official}: not a DeepSeek-VL2 checkout (deepseek_vl2/models/modeling_deepseek_vl_v2.py)")
    src = py.parent.parent / "src" / "DeepSeek-VL2"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(official, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".git"))
    for name in ("LICENSE-CODE", "LICENSE-MODEL"):  # pyproject names LICENSE-CODE; an extract may lack it
        if not (src / name).exists():
            (src / name).write_text("See https://github.com/deepseek-ai/DeepSeek-VL2\n")
    pip_install(py, "--no-deps", "--no-build-isolation", "--force-reinstall", str(src))


def write_shims(py: Path) -> Path:
    sp = site_packages(py)
    (sp / "xformers").mkdir(exist_ok=True)
    (sp / "xformers" / "__init__.py").write_text('"""xformers shim (CPU): see ops.py."""\n')
    (sp / "xformers" / "ops.py").write_text(XFORMERS_OPS)
    return sp


def probe(py: Path) -> subprocess.CompletedProcess:
    return run([py, HERE, "--worker", "--probe"], env=clean_env(), capture_output=True, text=True)


def ensure_env(venv: Path, official: Path, versions: tuple[str, ...], reinstall: bool) -> Path:
    py = venv_python(venv)
    marker = venv / READY_MARKER
    if marker.is_file() and py.exists() and not reinstall:
        info = json.loads(marker.read_text())
        res = probe(py)
        if res.returncode == 0:
            log(f"reusing {venv} (transformers {info.get('transformers')})")
            install_official(py, official)  # cheap; picks up a changed checkout
            return py
        log(f"{venv}: probe failed, reinstalling:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    if not py.exists():
        res = run([sys.executable, "-m", "venv", venv])
        if res.returncode != 0:
            raise SystemExit(f"could not create the virtual environment {venv}")
    failures = []
    for i, version in enumerate(versions):
        pip_install(py, *BASE_REQUIREMENTS, f"transformers=={version}")  # one resolve: consistent hub/tokenizers
        if i == 0:
            install_official(py, official)
            write_shims(py)
        res = probe(py)
        if res.returncode == 0:
            marker.write_text(json.dumps({"transformers": version, "requirements": BASE_REQUIREMENTS,
                                          "failed": failures}, indent=1) + "\n")
            log(f"transformers {version}: the official code imports and runs")
            return py
        tail = (res.stdout + res.stderr)[-1500:]
        failures.append({"transformers": version, "error": tail})
        log(f"transformers {version} does not work with the official code:\n{tail}")
    raise SystemExit("no transformers version works with the official code: " + json.dumps(failures)[-4000:])


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    py = ensure_env(Path(args.venv).resolve(), Path(args.official).resolve(), tuple(args.transformers),
                    args.reinstall)
    cmd = [py, HERE, "--worker", "--out", out, "--variants", *args.variants]
    res = run(cmd, env=clean_env())
    if res.returncode != 0:
        raise SystemExit(f"worker failed (rc {res.returncode})")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"done: {out} ({total / 1e6:.2f} MB)")


# ================================================================================================ worker
def bypass_torchvision_init() -> str:
    """Register the installed torchvision package without running its top-level __init__ (see module docstring)."""
    import importlib.util

    if "torchvision" in sys.modules:
        return str(getattr(sys.modules["torchvision"], "__version__", "?"))
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        raise SystemExit("torchvision is not installed in the reference environment")
    module = importlib.util.module_from_spec(spec)  # package with its real __path__, __init__ not executed
    sys.modules["torchvision"] = module
    from torchvision.version import __version__

    module.__version__ = __version__
    return __version__


TILE = 48                        # tile side in px: 48 = 3 * 14 + 6, like 384 = 27 * 14 + 6 (odd patch grid, 6 px cut)
PATCH = 14
# (width, height) in tiles, the real processor_config.json's order: every m x n grid with m * n <= 9
TILE_GRIDS = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (4, 1), (2, 2), (1, 5), (5, 1), (1, 6), (6, 1), (2, 3),
              (3, 2), (1, 7), (7, 1), (1, 8), (8, 1), (2, 4), (4, 2), (1, 9), (9, 1), (3, 3))
IMAGE_SIZE_PX = (240, 160)       # (W, H), 3:2: best candidate (144, 96) = 3 x 2 tiles (downscaled by 0.6)
IMAGE_SEED = 7
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
VOCAB_BPE = 400                  # byte-level BPE incl. the 3 specials; the processor appends 8 more (ids 400..407)
VOCAB_MODEL = 416                # the model's vocab_size: the tokenizer's 408 + 8 unused rows (like the real 129280)
CORPUS = """
Describe this picture in one short sentence. What is the capital of France? Answer in one word.
The capital of France is Paris. This picture shows a red square, a blue circle and a green line on a gray field.
A short sentence describes the image: colored shapes, stripes and noise. What color is the square? It is red.
The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven, eight, nine, ten.
Please answer the question about the image. The image is a picture of a small house near a river with trees.
Where is the cat? The cat is on the table. Read the text in the picture and write it down in one line.
How many objects are there in the picture? There are three objects. Which one is the largest? The blue one.
User and Assistant talk about pictures, charts, tables, documents and scenes. The answer is short and clear.
"""
TEXT_PROMPT = "What is the capital of France? Answer in one word."
IMAGE_PROMPT = "<image>\nDescribe this picture in one short sentence."
VISION = {"model_name": "siglip_so400m_patch14_384", "image_size": TILE, "patch_size": PATCH,
          "width": 32, "layers": 2, "heads": 2, "mlp_ratio": 3.7362, "global_pool": "map", "ignore_head": True,
          "class_token": False, "num_classes": 0, "use_checkpoint": False}
PROJECTOR = {"projector_type": "downsample_mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2, "mlp_ratio": 1,
             "downsample_ratio": 2}
LANGUAGE = {"vocab_size": VOCAB_MODEL, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 2,
            "n_routed_experts": 8, "ep_size": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1,
            "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 4096,
            "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None,
            "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0}
MLA = {"use_mla": True, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
       "v_head_dim": 16}
VARIANTS: dict[str, dict[str, Any]] = {
    # deepseek-vl2-tiny: no MLA (transformers' LlamaAttention, "mha_eager"), the real config's zero MLA dims
    "tiny": {"seed": 1001, "language": {
        "use_mla": False, "q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
        "v_head_dim": 0, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0}},
    # deepseek-vl2-small: MLA without q LoRA; routing made group-limited (the real config: greedy, n_group 1)
    "small": {"seed": 1002, "language": {
        **MLA, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
        "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0}},
    # deepseek-vl2 (base): MLA, noaux_tc with sigmoid scores + e_score_correction_bias, renormalised, scaled 2.0
    # (the real config: n_group 1 / topk_group 1; 2 / 1 here so that the group step selects)
    "base": {"seed": 1003, "language": {
        **MLA, "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3,
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.0}},
}
NEW_TOKENS = 5


def candidate_resolutions() -> list[list[int]]:
    return [[m * TILE, n * TILE] for m, n in TILE_GRIDS]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_replace_dir(tmp_dir: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp_dir, final)
    if old.exists():
        shutil.rmtree(old)


def synthetic_image():
    """A seeded non-square RGB image: gradient + colored shapes + noise (every tile different)."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = IMAGE_SIZE_PX
    rng = np.random.default_rng(IMAGE_SEED)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w * 255, yy / h * 255, (xx + yy) / (w + h) * 255], -1)
    img = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(img, "RGB")
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        x1, y1 = x0 + int(rng.integers(8, 60)), y0 + int(rng.integers(8, 45))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=color)
    return im


def build_tokenizer():
    """A small byte-level BPE (like DeepSeek's) as LlamaTokenizerFast, with DeepSeek's bos/eos/pad strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_BPE, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line.strip()] * 4, trainer)
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
                              add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
                              legacy=False, model_max_length=4096)
    assert (fast.convert_tokens_to_ids(BOS), fast.convert_tokens_to_ids(EOS), fast.convert_tokens_to_ids(PAD)) == (
        0, 1, 2), "special token ids"
    return fast


def model_config_dict(variant: str) -> dict[str, Any]:
    lang = {**LANGUAGE, **VARIANTS[variant]["language"]}
    return {"model_type": "deepseek_vl_v2", "architectures": ["DeepseekVLV2ForCausalLM"], "tile_tag": "2D",
            "global_view_pos": "head", "candidate_resolutions": candidate_resolutions(),
            "vision_config": dict(VISION), "projector_config": dict(PROJECTOR), "language_config": lang}


def init_weights(model, seed: int) -> dict[str, str]:
    """Deterministic, well-conditioned random weights for every parameter (the official init leaves
    e_score_correction_bias as torch.empty and gives near-uniform routing); returns the rule used per group."""
    import math

    import torch

    gen = torch.Generator().manual_seed(seed)
    n_embed = model.config.projector_config.n_embed
    rules: dict[str, str] = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            randn = torch.randn(shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                val, rule = 0.1 * randn, "N(0, 0.1^2)"
            elif name.endswith("mlp.gate.weight") and ".experts." not in name:  # MoEGate.weight [E, hidden]
                val, rule = randn * (2.0 / math.sqrt(shape[1])), "N(0, (2/sqrt(hidden))^2)"
            elif p.ndim == 1 and name.endswith(".weight") and "norm" in name.split(".")[-2]:
                val, rule = 1.0 + 0.1 * randn, "1 + N(0, 0.1^2)"
            elif name.endswith("bias"):
                val, rule = 0.05 * randn, "N(0, 0.05^2)"
            elif name in ("image_newline", "view_seperator"):
                val, rule = randn / math.sqrt(n_embed), "N(0, 1/n_embed)"
            elif name.endswith(("pos_embed", "attn_pool.latent")):
                val, rule = 0.5 * randn, "N(0, 0.5^2)"
            elif name.endswith("embed_tokens.weight"):
                val, rule = randn, "N(0, 1)"
            elif p.ndim >= 2:
                fan_in = p[0].numel()
                val, rule = randn / math.sqrt(fan_in), "N(0, 1/fan_in)"
            else:
                raise RuntimeError(f"no init rule for {name} {shape}")
            p.copy_(val)
            rules[name] = rule
    return rules


def clean_config_json(config) -> dict[str, Any]:
    """config.json with every key of the official config classes' __init__ (nested ones complete, not a diff)."""
    import inspect

    def keys_of(cfg) -> list[str]:
        return [k for k in inspect.signature(type(cfg).__init__).parameters if k not in ("self", "kwargs")]

    import torch
    import transformers

    out: dict[str, Any] = {"architectures": ["DeepseekVLV2ForCausalLM"], "model_type": config.model_type}
    for key in keys_of(config):
        value = getattr(config, key)
        out[key] = [list(v) for v in value] if key == "candidate_resolutions" else value
    for sub in ("vision_config", "projector_config", "language_config"):
        cfg = getattr(config, sub)
        out[sub] = {"model_type": cfg.model_type, **{k: getattr(cfg, k) for k in keys_of(cfg)}}
    out["torch_dtype"] = str(torch.float32).removeprefix("torch.")
    out["transformers_version"] = transformers.__version__
    return out


def tensor_summary(t) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def selection_margins(gate, x) -> dict[str, float]:
    """The gap between the k-th and (k+1)-th selection score per token (min / median), the scores the official
    MoEGate.forward feeds its final torch.topk (its code, replicated here for diagnostics only)."""
    import torch
    import torch.nn.functional as F

    n = x.shape[0] * x.shape[1]
    logits = F.linear(x.reshape(n, -1).float(), gate.weight.float())
    scores = logits.softmax(-1) if gate.scoring_func == "softmax" else logits.sigmoid()
    if gate.topk_method == "greedy":
        choice = scores
    else:
        base = scores + gate.e_score_correction_bias[None] if gate.topk_method == "noaux_tc" else scores
        grouped = base.view(n, gate.n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if gate.topk_method == "noaux_tc" else grouped.max(-1).values
        group_idx = group_scores.topk(gate.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(n, gate.n_group, gate.n_routed_experts // gate.n_group).reshape(n, -1)
        choice = base.masked_fill(~mask.bool(), 0.0)
    top = choice.sort(-1, descending=True).values
    gap = top[:, gate.top_k - 1] - top[:, gate.top_k]
    return {"min": float(gap.min()), "median": float(gap.median())}


def logits_margin(logits) -> dict[str, float]:
    top2 = logits.float().topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    return {"min": float(gap.min()), "median": float(gap.median())}


def worker_probe() -> None:
    """Import the official code and run one tiny forward (to choose a transformers version)."""
    bypass_torchvision_init()
    import torch
    from deepseek_vl2.models import DeepseekVLV2ForCausalLM, DeepseekVLV2Processor  # noqa: F401
    from deepseek_vl2.models.modeling_deepseek_vl_v2 import DeepseekVLV2Config

    for variant in VARIANTS:
        torch.manual_seed(0)
        model = DeepseekVLV2ForCausalLM(DeepseekVLV2Config(**model_config_dict(variant))).eval()
        init_weights(model, 0)
        images = torch.zeros(1, 2, 3, TILE, TILE)
        h = -(-(TILE // PATCH) // 2)
        n_img = h * (h + 1) + 1 + h * (h + 1)
        ids = torch.full((1, n_img + 3), 5, dtype=torch.long)
        seq_mask = torch.zeros(1, n_img + 3, dtype=torch.bool)
        seq_mask[0, 1:1 + n_img] = True
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(seq_mask), images=images,
                        images_seq_mask=seq_mask, images_spatial_crop=torch.tensor([[[1, 1]]]), use_cache=False)
        assert out.logits.shape == (1, n_img + 3, VOCAB_MODEL) and torch.isfinite(out.logits).all()
    print("probe ok", flush=True)


def run_case(model, processor, case: dict[str, Any], pil_images: list) -> tuple[dict, dict]:
    """The official processor + forward on one conversation; returns (tensors, metadata)."""
    import torch

    name = case["name"]
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    enc = processor(conversations=case["conversation"], images=pil_images, force_batchify=True, system_prompt="")
    for key in ("input_ids", "attention_mask", "labels", "images", "images_seq_mask", "images_spatial_crop"):
        tensors[f"{name}.{key}"] = enc[key].contiguous()
    meta["sft_format"] = enc["sft_format"][0]
    meta["seq_lens"] = list(enc["seq_lens"])
    meta["num_image_tokens"] = int(enc["images_seq_mask"].sum())
    meta["images_spatial_crop"] = enc["images_spatial_crop"][0].tolist()
    meta["image_token_id"] = int(processor.image_token_id)
    meta["decoded_input"] = processor.tokenizer.decode(enc["input_ids"][0].tolist())

    inputs = {k: enc[k] for k in ("input_ids", "images", "images_seq_mask", "images_spatial_crop")}
    # hooks: every MoE layer's gate (official MoEGate returns (topk_idx, topk_weight, aux_loss)), vision, projector
    captured: dict[str, torch.Tensor] = {}
    handles = []
    moe_layers = []
    for i, layer in enumerate(model.language.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        moe_layers.append(i)

        def gate_hook(mod, args, output, i=i):
            captured[f"topk_idx.{i}"] = output[0].detach().clone()
            captured[f"topk_weight.{i}"] = output[1].detach().clone()
            captured[f"gate_input.{i}"] = args[0].detach().clone()
        handles.append(gate.register_forward_hook(gate_hook))
    handles.append(model.vision.register_forward_hook(
        lambda m, a, o: captured.__setitem__("vision_features", o.detach().clone())))
    handles.append(model.projector.register_forward_hook(
        lambda m, a, o: captured.__setitem__("projector_output", o.detach().clone())))
    with torch.no_grad():
        embeds = model.prepare_inputs_embeds(**inputs)
        tensors[f"{name}.inputs_embeds"] = embeds.detach().clone()
        captured.clear()  # keep what the full forward below records
        out = model(**inputs, attention_mask=enc["attention_mask"], use_cache=False, output_hidden_states=True,
                    return_dict=True)
        again = model(inputs_embeds=embeds, attention_mask=enc["attention_mask"], use_cache=False).logits
    for h in handles:
        h.remove()
    meta["forward_from_inputs_embeds_equal"] = bool(torch.equal(again, out.logits))
    tensors[f"{name}.logits"] = out.logits.detach().clone()
    for j, hs in enumerate(out.hidden_states):
        tensors[f"{name}.hidden_states.{j}"] = hs.detach().clone()
    for key in ("vision_features", "projector_output"):
        if key in captured:
            tensors[f"{name}.{key}"] = captured.pop(key)
    margins = {}
    for i in moe_layers:
        idx, w = captured[f"topk_idx.{i}"], captured[f"topk_weight.{i}"]
        order = idx.argsort(-1)
        tensors[f"{name}.topk_idx.{i}"] = idx
        tensors[f"{name}.topk_weight.{i}"] = w
        tensors[f"{name}.topk_idx_sorted.{i}"] = idx.gather(-1, order)
        tensors[f"{name}.topk_weight_sorted.{i}"] = w.gather(-1, order)
        tensors[f"{name}.gate_input.{i}"] = captured[f"gate_input.{i}"]
        margins[str(i)] = selection_margins(model.language.model.layers[i].mlp.gate, captured[f"gate_input.{i}"])
    meta["moe_layers"] = moe_layers
    meta["routing_selection_margin"] = margins
    meta["logits_top1_top2_margin"] = logits_margin(out.logits[0])

    # greedy continuation: (1) without cache (official forward on the growing sequence, argmax, no eos stop)
    ids, attn, smask = enc["input_ids"], enc["attention_mask"], enc["images_seq_mask"]
    steps = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, attention_mask=attn, images=enc["images"], images_seq_mask=smask,
                           images_spatial_crop=enc["images_spatial_crop"], use_cache=False).logits[:, -1]
            steps.append(logits.clone())
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            attn = torch.cat([attn, torch.ones_like(nxt, dtype=attn.dtype)], 1)
            smask = torch.cat([smask, torch.zeros_like(nxt, dtype=smask.dtype)], 1)
    greedy = ids[:, enc["input_ids"].shape[1]:]
    tensors[f"{name}.greedy_nocache.tokens"] = greedy.contiguous()
    tensors[f"{name}.greedy_nocache.step_logits"] = torch.stack(steps, 1)
    meta["greedy_nocache"] = {"tokens": greedy[0].tolist(), "text": processor.tokenizer.decode(greedy[0].tolist()),
                              "step_logit_margin": logits_margin(torch.stack(steps, 1)[0])}
    # (2) the official generate(): the README's call (language.generate on prepare_inputs_embeds) and the VL
    # model's own generate (input_ids + images through its prepare_inputs_for_generation)
    gen_kw = {"pad_token_id": processor.tokenizer.eos_token_id, "bos_token_id": processor.tokenizer.bos_token_id,
              "eos_token_id": processor.tokenizer.eos_token_id, "max_new_tokens": NEW_TOKENS, "do_sample": False,
              "use_cache": True}
    meta["generate"] = {}
    calls = {
        "language_generate_inputs_embeds": lambda: model.language.generate(
            inputs_embeds=embeds, attention_mask=enc["attention_mask"], **gen_kw),
        "vl_generate_input_ids": lambda: model.generate(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], images=enc["images"],
            images_seq_mask=enc["images_seq_mask"], images_spatial_crop=enc["images_spatial_crop"], **gen_kw),
    }
    for label, call in calls.items():
        try:
            with torch.no_grad():
                seq = call()
        except Exception as e:  # recorded, not fatal: the fixture says why generate() is absent
            meta["generate"][label] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        new = seq[:, enc["input_ids"].shape[1]:] if seq.shape[1] > NEW_TOKENS else seq
        tensors[f"{name}.generate.{label}"] = new.contiguous()
        n = new.shape[1]
        meta["generate"][label] = {
            "ok": True, "tokens": new[0].tolist(), "returned_shape": list(seq.shape),
            "stopped_at_eos": bool(n < NEW_TOKENS),
            "agrees_with_greedy_nocache": bool(torch.equal(new, greedy[:, :n]))}
    return tensors, meta


def pip_freeze() -> list[str]:
    res = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True)
    return res.stdout.splitlines()


def worker_main(out: Path, variants: list[str]) -> None:
    tv_version = bypass_torchvision_init()
    import platform

    import deepseek_vl2
    import PIL
    import safetensors
    import timm
    import tokenizers
    import torch
    import transformers
    from deepseek_vl2.models import DeepseekVLV2ForCausalLM, DeepseekVLV2Processor
    from deepseek_vl2.models.modeling_deepseek_vl_v2 import DeepseekVLV2Config
    from PIL import Image
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    official_dir = Path(deepseek_vl2.__file__).parent
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": tv_version,
                "transformers": transformers.__version__, "timm": timm.__version__,
                "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                "pillow": PIL.__version__, "pip_freeze": pip_freeze()}
    official_sources = {str(p.relative_to(official_dir.parent)): sha256(p)
                        for p in sorted(official_dir.rglob("*.py"))}

    # the input image: written once, and read back from the PNG (as a test would)
    png = out / "inputs" / "synthetic_3x2.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    buf = tempfile.SpooledTemporaryFile()
    synthetic_image().save(buf, format="PNG")
    buf.seek(0)
    atomic_write_bytes(png, buf.read())
    image = Image.open(png).convert("RGB")
    cases = [
        {"name": "image", "image": str(png.relative_to(out)), "prompt": IMAGE_PROMPT,
         "conversation": [{"role": "<|User|>", "content": IMAGE_PROMPT, "images": [str(png.relative_to(out))]},
                          {"role": "<|Assistant|>", "content": ""}]},
        {"name": "text", "image": None, "prompt": TEXT_PROMPT,
         "conversation": [{"role": "<|User|>", "content": TEXT_PROMPT}, {"role": "<|Assistant|>", "content": ""}]},
    ]

    for variant in variants:
        seed = VARIANTS[variant]["seed"]
        vdir = out / variant
        vdir.mkdir(parents=True, exist_ok=True)
        log(f"{variant}: building (seed {seed})")
        # ---- tokenizer + processor (the processor adds <image>, grounding and chat tokens to the tokenizer)
        processor = DeepseekVLV2Processor(tokenizer=build_tokenizer(), candidate_resolutions=candidate_resolutions(),
                                          patch_size=PATCH, downsample_ratio=PROJECTOR["downsample_ratio"])
        assert len(processor.tokenizer) <= VOCAB_MODEL, len(processor.tokenizer)
        # ---- model
        torch.manual_seed(seed)
        config = DeepseekVLV2Config(**model_config_dict(variant))
        model = DeepseekVLV2ForCausalLM(config).eval()
        init_rules = init_weights(model, seed)
        tmp_ckpt = Path(tempfile.mkdtemp(prefix=".checkpoint.", dir=vdir))
        model.save_pretrained(tmp_ckpt, safe_serialization=True)
        processor.save_pretrained(tmp_ckpt)
        (tmp_ckpt / "generation_config.json").unlink(missing_ok=True)  # the hub repos have none
        (tmp_ckpt / "config.json").write_text(json.dumps(clean_config_json(config), indent=2) + "\n")
        os.chmod(tmp_ckpt, 0o755)
        for f in tmp_ckpt.iterdir():
            os.chmod(f, 0o644)
        atomic_replace_dir(tmp_ckpt, vdir / "checkpoint")
        ckpt = vdir / "checkpoint"
        # ---- everything below runs on what was saved: reloaded with the official from_pretrained
        reloaded, info = DeepseekVLV2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32,
                                                                 attn_implementation="eager",
                                                                 output_loading_info=True)
        reloaded.eval()
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"{variant}: checkpoint does not load cleanly: {bad}"
        saved = load_file(str(ckpt / "model.safetensors"))
        mine = model.state_dict()
        assert set(saved) == set(mine) and all(torch.equal(saved[k], mine[k]) for k in saved)
        processor = DeepseekVLV2Processor.from_pretrained(ckpt)
        lm_cfg = reloaded.config.language_config
        attn_class = type(reloaded.language.model.layers[0].self_attn).__name__
        log(f"{variant}: attention {attn_class}, attn_implementation {lm_cfg._attn_implementation}")

        tensors: dict[str, torch.Tensor] = {}
        case_meta = []
        for case in cases:
            imgs = [image] if case["image"] else []
            t, m = run_case(reloaded, processor, case, imgs)
            if case["image"]:
                assert m["images_spatial_crop"] == [[3, 2]], m["images_spatial_crop"]  # 3 wide x 2 high
            tensors.update(t)
            case_meta.append({**{k: case[k] for k in ("name", "image", "prompt", "conversation")}, **m})
        tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
        buf = tempfile.NamedTemporaryFile(delete=False, dir=vdir, prefix=".reference.", suffix=".tmp")
        buf.close()
        save_file(tensors, buf.name, metadata={"format": "pt"})  # one key: safetensors orders metadata randomly
        os.chmod(buf.name, 0o644)
        os.replace(buf.name, vdir / "reference.safetensors")

        meta = {
            "what": "outputs of the official DeepSeek-VL2 code (github.com/deepseek-ai/DeepSeek-VL2) on this tiny "
                    "random checkpoint; see ../README.md",
            "variant": variant,
            "command": "python scripts/deepseek_vl2_reference.py --out tests/golden/deepseek_vl2_reference",
            "versions": versions,
            "official_sources_sha256": official_sources,
            "substitutions": [
                "xformers.ops.memory_efficient_attention -> shim computing exactly softmax(q k^T / sqrt(D)) v "
                "with torch (q, k, v in [B, N, H, D]); xformers has no CPU build",
                "torchvision's top-level __init__ not executed (its compiled _C.so is a CUDA build that cannot load "
                "with the CPU torch); torchvision.transforms used unmodified",
            ],
            "seeds": {"weights": seed, "torch_manual_seed": seed, "image": IMAGE_SEED},
            "weight_init": sorted(set(init_rules.values())),
            "weight_init_rules": init_rules,
            "dtype": "float32", "attn_implementation": lm_cfg._attn_implementation,
            "language_attention_class": attn_class,
            "torch_threads": torch.get_num_threads(),
            "config": json.loads((ckpt / "config.json").read_text()),
            "processor_config": json.loads((ckpt / "processor_config.json").read_text()),
            "processor_derived": {
                "image_size": processor.image_size, "patch_size": processor.patch_size,
                "downsample_ratio": processor.downsample_ratio,
                "tokens_per_tile_side": -(-(processor.image_size // processor.patch_size)
                                          // processor.downsample_ratio),
                "vit_patch_grid": processor.image_size // processor.patch_size,
                "pad_color": [int(x * 255) for x in processor.image_transform.mean]},
            "tokenizer": {"len": len(processor.tokenizer), "bos_token_id": processor.tokenizer.bos_token_id,
                          "eos_token_id": processor.tokenizer.eos_token_id,
                          "pad_token_id": processor.tokenizer.pad_token_id,
                          "image_token_id": processor.image_token_id,
                          "added_tokens": {t: processor.tokenizer.convert_tokens_to_ids(t)
                                           for t in [BOS, EOS, PAD, "<image>", "<|ref|>", "<|/ref|>", "<|det|>",
                                                     "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>"]}},
            "image": {"path": cases[0]["image"], "size_wh": list(IMAGE_SIZE_PX), "tile_px": TILE,
                      "sha256": sha256(png)},
            "cases": case_meta,
            "tensors": {k: tensor_summary(v) for k, v in tensors.items()},
            "checkpoint_files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                                 for p in sorted(ckpt.iterdir()) if p.is_file()},
            "checkpoint_parameters": {k: list(v.shape) for k, v in sorted(saved.items())},
        }
        atomic_write_bytes(vdir / "reference.json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode())
        size = sum(p.stat().st_size for p in vdir.rglob("*") if p.is_file())
        log(f"{variant}: wrote {vdir} ({size / 1e6:.2f} MB)")


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/golden/deepseek_vl2_reference", help="fixture directory")
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help="the isolated reference environment (reused)")
    ap.add_argument("--official", default=str(DEFAULT_OFFICIAL), help="DeepSeek-VL2 checkout (has deepseek_vl2/)")
    ap.add_argument("--transformers", nargs="+", default=list(TRANSFORMERS_CANDIDATES),
                    help="transformers versions to try, newest first")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reinstall", action="store_true", help="reinstall the environment even if it is ready")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        if args.probe:
            worker_probe()
        else:
            worker_main(Path(args.out).resolve(), args.variants)
    else:
        driver(args)


if __name__ == "__main__":
    main()
