"""One interface for every next-layer expert predictor (paper §3.2) and its baselines.

A predictor sees a *batch* in the trace contract's layout (``x``/``logits``/``topk`` lists over MoE
layer ordinals plus the per-token tensors ``token_ids``, ``sample_index``, ``position``, ...) and returns,
for every MoE pair ``l -> l+d`` (``l = 0..L-1-d``; ``d = dims.lookahead``, 1 in the paper: the adjacent pairs),
scores over the ``n`` experts of layer ``l+d`` computed only from what is available at layer ``l`` (the oracle, an
upper bound, is the one exception). ``dims.target(l)`` is pair ``l``'s target layer.

- ``forward(batch)`` returns the pre-softmax logits the KL objective (§3.4) is applied to;
- ``priorities(batch, "token")`` returns per-token expert priorities (π̂ for the learned methods), and
  ``priorities(batch, "batch")`` sums them over the batch's tokens: s_e = Σ_t π̂_{t,e} (§3.2);
- ``trainable_params()`` counts the parameters that require grad (Table 3), never a formula;
- ``save(dir)`` / ``load_predictor(dir)`` persist ``predictor.safetensors`` + ``meta.json``.

Methods are named in ``specprefetch.registry`` (a built-in registers its class with ``@register("name")`` when the
module the registry names is imported) or come from another installed package through the entry-point group
``specprefetch.predictors`` (a ``Predictor`` subclass with ``label`` and ``color``); ``predictor_class`` imports either
on demand, so adding a method never touches this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from specprefetch import registry
from specprefetch.contracts import METHODS as METHODS  # every method name, plugins included (a live view)
from specprefetch.contracts import (
    PREDICTOR_FORMAT,
    check_finite_tensors,
    check_model_dims,
    load_safetensors,
    member,
    read_doc,
    require,
)
from specprefetch.io import SpecPrefetchError, atomic_path, sha256_file, write_json_atomic

WEIGHTS_FILE = "predictor.safetensors"
META_FILE = "meta.json"
Aggregate = Literal["token", "batch"]
Batch = Mapping[str, Any]


class PredictorError(SpecPrefetchError):
    """A predictor checkpoint or a batch does not fit the predictor; the message names the file/key."""


def ahead_tag(d: int) -> str:
    """The suffix that names a predictor at look-ahead distance ``d``: "" for the paper's d = 1, ".d<d>" beyond."""
    return "" if int(d) == 1 else f".d{int(d)}"


def ahead_name(method: str, d: int) -> str:
    """A predictor's name at distance ``d`` (``specprefetch``, ``specprefetch.d2``): its directory's stem and the
    runtime's provider key."""
    return f"{method}{ahead_tag(d)}"


@dataclass(frozen=True)
class PredictorDims:
    """Shapes a predictor is built for: L MoE layers, hidden size D, n routed experts, top-K.

    ``vocab_size`` is only used by token-id based predictors (the draft model); ``scoring`` and ``arch``
    tell FATE how the native router turns logits into routing scores. ``lookahead`` is the distance d of the pairs
    (layer l predicts layer l+d; the paper's d = 1, more is beyond the paper).
    """

    n_layers: int
    hidden_size: int
    n_experts: int
    top_k: int
    vocab_size: int | None = None
    scoring: str = "softmax"
    arch: str = ""
    lookahead: int = 1

    def __post_init__(self) -> None:
        if self.n_layers < 2:
            raise PredictorError(f"next-layer prediction needs >= 2 MoE layers, got n_layers={self.n_layers}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) \
                or not 1 <= self.lookahead < self.n_layers:
            raise PredictorError(f"invalid predictor dims: lookahead={self.lookahead!r} (an integer d with "
                                 f"1 <= d < n_layers={self.n_layers}: layer l predicts layer l+d)")
        for name in ("hidden_size", "n_experts", "top_k"):
            if getattr(self, name) < 1:
                raise PredictorError(f"invalid predictor dims: {name}={getattr(self, name)}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise PredictorError(f"invalid predictor dims: scoring={self.scoring!r} (softmax or sigmoid)")

    @property
    def n_pairs(self) -> int:
        """The (l, l+d) pairs predicted: L - d."""
        return self.n_layers - self.lookahead

    def target(self, pair: int) -> int:
        """The MoE ordinal pair ``pair`` predicts: l + d."""
        return pair + self.lookahead

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PredictorDims:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], vocab_size: int | None = None) -> PredictorDims:
        """Dims of a trace directory (its manifest is the single source of truth for the shapes)."""
        try:
            return cls(
                n_layers=int(manifest["n_moe_layers"]),
                hidden_size=int(manifest["hidden_size"]),
                n_experts=int(manifest["n_experts"]),
                top_k=int(manifest["top_k"]),
                vocab_size=vocab_size,
                scoring=str(manifest.get("scoring", "softmax")),
                arch=str(manifest.get("arch", "")),
            )
        except KeyError as exc:
            raise PredictorError(f"trace manifest lacks key {exc.args[0]!r}") from None


def next_layer_kl(preds: Sequence[Tensor], logits: Sequence[Tensor], lookahead: int = 1) -> Tensor:
    """Mean over layer pairs of the token-mean KL(π^{l+d} ‖ π̂^{l+d}); ``logits`` are all L layers' router
    logits (the target of pair l is layer l+d, d = ``lookahead``: 1 in the paper), ``preds`` the L−d predictions.
    Computed in float32 (the paper's objective, §3.4)."""
    if len(preds) != len(logits) - lookahead:
        raise SpecPrefetchError(f"KL loss: {len(preds)} predictions for {len(logits)} layers at look-ahead "
                                f"{lookahead} (need L-{lookahead})")
    terms = []
    for l, z in enumerate(preds):
        target = F.log_softmax(logits[l + lookahead].detach().float(), dim=-1)
        terms.append(F.kl_div(F.log_softmax(z.float(), dim=-1), target, log_target=True, reduction="batchmean"))
    return torch.stack(terms).mean()


_REGISTRY: dict[str, type[Predictor]] = {}


def register(name: str) -> Callable[[type[Predictor]], type[Predictor]]:
    """Class decorator: make ``name`` buildable through ``build_predictor``."""

    def deco(cls: type[Predictor]) -> type[Predictor]:
        cls.method = name
        _REGISTRY[name] = cls
        return cls

    return deco


def predictor_class(method: str) -> type[Predictor]:
    """The class of ``method``: a built-in's module registers it on import; a plugin's entry point names it."""
    if method not in _REGISTRY:
        try:
            spec = registry.method(method)
        except registry.UnknownName as exc:
            raise PredictorError(str(exc)) from None
        obj = registry.import_target(spec)
        if ":" in spec.target:  # a plugin: the entry point names the class itself
            if not (isinstance(obj, type) and issubclass(obj, Predictor)):
                raise PredictorError(f"method {method!r} ({spec.source}): {spec.target} is not a Predictor subclass")
            if obj.learned != spec.learned:
                raise PredictorError(f"method {method!r} ({spec.source}): learned={obj.learned} on the class, "
                                     f"{spec.learned} in its registry entry")
            obj.method = method
            _REGISTRY[method] = obj
        if method not in _REGISTRY:
            raise PredictorError(f"method {method!r}: importing {spec.target} registered no class "
                                 f"(@register({method!r}) missing)")
    return _REGISTRY[method]


PER_MODEL = "_per_model"


def method_config(cfg: Mapping[str, Any] | None, method: str, model: str | None = None) -> dict[str, Any]:
    """The method's section of a full config or of its ``predictors`` section (empty if absent), resolved for
    ``model``: a key ``<k>_per_model: {model: value}`` replaces ``<k>`` for the models it names (the others keep
    ``<k>``; ``model=None`` keeps ``<k>`` everywhere). The ``*_per_model`` keys themselves are dropped, so a
    predictor's ``method_cfg`` (and its meta.json, which ``load_predictor`` rebuilds from) holds only the values it
    was built with. Given a full config, a per-model table naming a model the config lacks is an error (a typo
    would otherwise silently fall back to ``<k>``)."""
    if cfg is None:
        return {}
    section = cfg.get("predictors", cfg)
    raw = dict(section.get(method) or {})
    out = {k: v for k, v in raw.items() if not k.endswith(PER_MODEL)}
    known = cfg.get("models") if "predictors" in cfg else None
    for key, table in raw.items():
        if not key.endswith(PER_MODEL):
            continue
        where = f"predictors.{method}.{key}"
        if not isinstance(table, Mapping):
            raise PredictorError(f"invalid {where}: expected a mapping model -> value, got {table!r}")
        if known is not None and set(table) - set(known):
            raise PredictorError(f"invalid {where}: unknown model(s) {', '.join(sorted(set(table) - set(known)))} "
                                 f"(models: {', '.join(known)})")
        if model is not None and model in table:
            out[key[: -len(PER_MODEL)]] = table[model]
    return out


def build_predictor(method: str, cfg: Mapping[str, Any] | None, dims: PredictorDims,
                    model: str | None = None) -> Predictor:
    """A freshly initialised predictor of ``method`` for ``dims`` (weights from the global torch seed), with the
    method's per-model settings of ``model`` (see ``method_config``)."""
    cls = predictor_class(method)
    return cls(dims, method_config(cfg, method, model))


# --------------------------------------------------------------------------------------------- helpers


def multi_hot(idx: Tensor, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[T, K] expert ids -> [T, n] indicator (ids outside [0, n), e.g. -1 padding, are ignored)."""
    idx = idx.long()
    valid = (idx >= 0) & (idx < n)
    out = torch.zeros(idx.shape[0], n + 1, dtype=dtype, device=idx.device)
    out.scatter_(1, torch.where(valid, idx, torch.full_like(idx, n)), 1.0)
    return out[:, :n]


def sample_runs(sample_index: Tensor) -> tuple[Tensor, Tensor]:
    """(starts, lengths) of the runs of equal ``sample_index``: the samples of a contiguous batch."""
    _, counts = torch.unique_consecutive(sample_index, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    return starts, counts


def check_sample_contiguous(batch: Batch, who: str) -> None:
    """Methods that look at other tokens of a sample need each sample's tokens contiguous and in order.

    A token-shuffled batch (``TraceReader.iter_batches(shuffle=True)``) would silently pair unrelated
    tokens, so it is rejected here.
    """
    sidx = batch["sample_index"]
    pos = batch["position"].long()
    if sidx.numel() < 2:
        return
    same = sidx[1:] == sidx[:-1]
    if bool((same & (pos[1:] <= pos[:-1])).any()):
        raise PredictorError(f"{who} needs batches whose samples are contiguous and in sequence order "
                             "(got positions that do not increase within a sample: a token-shuffled batch?)")
    starts, _ = sample_runs(sidx)
    if torch.unique(sidx).numel() != starts.numel():
        raise PredictorError(f"{who} needs each sample's tokens contiguous in the batch (a sample appears twice)")


# --------------------------------------------------------------------------------------------- the base class


class Predictor(nn.Module):
    """Base class: see the module docstring for the contract every method follows."""

    method: ClassVar[str] = ""
    learned: ClassVar[bool] = True
    # A plugin's registry metadata (built-ins have theirs in specprefetch.registry): its display label and #RRGGBB
    # colour in every table and figure, and whether the runtime may prefetch with it (a policy of the same name;
    # the class then implements ``layer_token_scores(layer, x)``).
    label: ClassVar[str | None] = None
    color: ClassVar[str | None] = None
    runtime_policy: ClassVar[bool] = False
    # A zero priority means "not a candidate" (Naive Prefetch has only the previous token's K experts).
    empty_when_zero: ClassVar[bool] = False
    # Where the runtime asks for the priorities of layer l+d: at layer l's router ("router", the paper's point), or
    # ("pre_attention") before layer l+d's own attention, from that layer's pre-attention input (batch key ``pre``).
    stage: ClassVar[str] = "router"

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.method_cfg = dict(method_cfg or {})

    # -- prediction
    def forward(self, batch: Batch) -> list[Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, preds: Sequence[Tensor], batch: Batch) -> Tensor:
        """The training objective of ``preds = forward(batch)``: the paper's next-layer KL (§3.4); a method with
        another objective overrides it."""
        return next_layer_kl(preds, batch["logits"], self.dims.lookahead)

    def token_scores(self, batch: Batch) -> list[Tensor]:
        """Per-token priorities [T, n] per pair; the learned default is π̂ = softmax(ẑ) in float32."""
        return [F.softmax(z.float(), dim=-1) for z in self.forward(batch)]

    def priorities(self, batch: Batch, aggregate: Aggregate = "token") -> list[Tensor]:
        """Expert priorities for layers d..L-1: [T, n] per token, or [n] summed over the batch (§3.2)."""
        scores = self.token_scores(batch)
        if aggregate == "token":
            return scores
        if aggregate == "batch":
            return [s.sum(dim=0) for s in scores]
        raise PredictorError(f"invalid aggregate {aggregate!r}: use 'token' or 'batch'")

    # -- bookkeeping
    def trainable_params(self) -> int:
        """Number of trainable parameters, counted from the module (Table 3)."""
        return int(sum(p.numel() for p in self.parameters() if p.requires_grad))

    def fit_statistics(self, reader: Any) -> None:
        """Training-free methods collect what they need from the training trace (no-op for learned ones)."""

    def _x(self, batch: Batch, layer: int) -> Tensor:
        """Router input of MoE ordinal ``layer`` as the predictor's compute dtype (traces store bf16)."""
        x = batch["x"][layer]
        if x.shape[-1] != self.dims.hidden_size:
            raise PredictorError(f"{self.method}: x.{layer} has hidden size {x.shape[-1]}, "
                                 f"predictor built for D={self.dims.hidden_size}")
        return x.to(self._param_dtype())

    def _param_dtype(self) -> torch.dtype:
        for p in self.parameters():
            return p.dtype
        return torch.float32

    def check_batch(self, batch: Batch) -> None:
        for key in ("x", "logits", "topk"):
            if key in batch and len(batch[key]) != self.dims.n_layers:
                raise PredictorError(f"{self.method}: batch[{key!r}] has {len(batch[key])} layers, "
                                     f"predictor built for L={self.dims.n_layers}")

    # -- persistence
    def meta(self) -> dict[str, Any]:
        return {
            "format": PREDICTOR_FORMAT,
            "method": self.method,
            "learned": self.learned,
            "dims": asdict(self.dims),
            "method_cfg": self.method_cfg,
            "trainable_params": self.trainable_params(),
        }

    def save(self, out_dir: str | Path, extra_meta: Mapping[str, Any] | None = None) -> Path:
        """Write ``predictor.safetensors`` (parameters and buffers) and ``meta.json`` into ``out_dir``.

        Each file is written atomically; callers that need the directory itself to appear atomically
        (train_predictor) save into an ``atomic_path`` directory.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        with atomic_path(out / WEIGHTS_FILE) as tmp:
            # No safetensors metadata: with more than one key its order in the header is not stable
            # across runs, and the same seed must give the same bytes. meta.json carries it instead.
            save_file(state, str(tmp))
        meta = {**self.meta(), **(extra_meta or {})}
        meta["weights"] = {"file": WEIGHTS_FILE, "sha256": sha256_file(out / WEIGHTS_FILE),
                           "tensors": sorted(state)}
        write_json_atomic(out / META_FILE, meta)
        return out


def read_meta(pred_dir: str | Path) -> dict[str, Any]:
    path = Path(pred_dir) / META_FILE
    if not path.is_file():
        raise PredictorError(f"{path}: missing; {pred_dir} is not a saved predictor")
    meta = read_doc(path, PREDICTOR_FORMAT, "predictor metadata", required=("method", "dims", "weights"))
    require(meta, "method", str, str(path))
    check_model_dims(require(meta, "dims", dict, str(path)), str(path))  # positive ints, top_k <= n_experts
    weights = require(meta, "weights", dict, str(path))
    require(weights, "file", str, f"{path} weights")
    require(weights, "sha256", str, f"{path} weights")
    member(Path(pred_dir), weights["file"], f"predictor metadata {META_FILE}")
    return meta


def load_predictor(pred_dir: str | Path, map_location: str | torch.device = "cpu") -> Predictor:
    """Rebuild a saved predictor from ``meta.json`` and load its weights (checked against their sha256)."""
    pred_dir = Path(pred_dir)
    meta = read_meta(pred_dir)
    wpath = member(pred_dir, meta["weights"]["file"], f"predictor metadata {META_FILE}")
    if not wpath.is_file():
        raise PredictorError(f"{wpath}: missing (listed in {pred_dir / META_FILE})")
    digest = sha256_file(wpath)
    if digest != meta["weights"]["sha256"]:
        raise PredictorError(f"{wpath}: sha256 {digest[:12]}... does not match {META_FILE}: the file is corrupt")
    state = load_safetensors(wpath, "predictor weights", device=str(map_location))
    check_finite_tensors(state, str(wpath))  # NaN weights would score as a (chance-level) result
    try:
        dims = PredictorDims.from_dict(meta["dims"])
    except TypeError as exc:
        raise PredictorError(f"{pred_dir / META_FILE}: bad dims ({exc})") from None
    pred = predictor_class(meta["method"])(dims, meta.get("method_cfg") or {})
    try:
        pred.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise PredictorError(f"{wpath}: does not fit a {meta['method']} predictor with dims {meta['dims']}: "
                             f"{str(exc).splitlines()[0]}") from None
    pred.to(map_location)
    pred.eval()
    return pred
