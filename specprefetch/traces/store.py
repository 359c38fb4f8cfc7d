"""Routing-trace storage: sharded safetensors written atomically, read back verified and streamed.

A trace directory holds, for every valid token of a workload, the router input ``x`` and the router
logits / executed top-K of every MoE layer, plus per-token metadata. It is the only thing the
predictors and FATE need, so a model never has to be loaded twice. Layout (the shared contract):

- ``shard-00000.safetensors`` ...: ``x.{i}`` [T, D], ``logits.{i}`` [T, n], ``topk.{i}`` [T, K] int32,
  ``token_ids`` int64, ``sample_index`` int64, ``position`` int32, ``is_image`` uint8, ``is_prompt`` uint8;
  optionally (``traces.pre_attention``; the manifest's ``dtypes`` then name ``pre``) ``pre.{i}`` [T, D]: MoE layer
  i's pre-attention norm output, what its attention read (the pre-attention predictor's input, beyond the paper).
  Samples are never split across shards; a sample's tokens are contiguous and in sequence order.
- ``routers.safetensors``: ``gate.{i}.weight`` [n, D] float32 (+ ``gate.{i}.bias`` /
  ``gate.{i}.e_score_correction_bias`` where the arch has them).
- ``manifest.json``, written last: its presence marks a complete trace. It records the sha256 and
  size of every file so a reader detects truncation and bit rot before using a tensor.

The writer builds the whole directory under a temporary name and renames it into place on success,
so an interrupted extraction leaves neither a manifest nor an output directory.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

from specprefetch.contracts import (
    TRACE_FORMAT,
    check_finite_tensors,
    finite,
    load_safetensors,
    member,
    read_doc,
    require,
    reraise_as,
)
from specprefetch.io import SpecPrefetchError, atomic_path, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ROUTERS = "routers.safetensors"
PER_LAYER_KEYS = ("x", "logits", "topk")
PRE_KEY = "pre"  # the optional per-layer pre-attention input


def layer_keys(pre_attention: bool) -> tuple[str, ...]:
    """The per-layer tensors of a trace (its shards and batches): ``pre`` too where it stores the pre-attention
    inputs."""
    return (*PER_LAYER_KEYS, PRE_KEY) if pre_attention else PER_LAYER_KEYS
# Per-token tensors and their stored dtypes (fixed by the contract).
TOKEN_KEYS: dict[str, torch.dtype] = {
    "token_ids": torch.int64,
    "sample_index": torch.int64,
    "position": torch.int32,
    "is_image": torch.uint8,
    "is_prompt": torch.uint8,
}
TOPK_DTYPE = torch.int32
INPUT_DTYPES = ("bfloat16", "float16", "float32")
LOGITS_DTYPES = ("float32", "float16")
REQUIRED_META = ("model", "workload", "arch", "n_experts", "top_k", "hidden_size", "moe_layers", "scoring")


class TraceError(SpecPrefetchError):
    """A trace directory is incomplete, corrupt or inconsistent with its manifest; the message names the file."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def dtype_from_name(name: str, allowed: Sequence[str], what: str) -> torch.dtype:
    """Map a config dtype name ('bfloat16') to a torch dtype, rejecting names the format does not allow."""
    name = str(name).removeprefix("torch.")
    if name not in allowed:
        raise SpecPrefetchError(f"invalid {what} {name!r}: use one of {', '.join(allowed)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------- writer


class TraceWriter:
    """Buffer per-sample routing tensors and write them as a trace directory (see module docstring).

    Use as a context manager. Memory is bounded by one shard: a shard is flushed as soon as the
    buffer reaches ``shard_tokens`` tokens, and before a sample that would overflow a non-empty
    buffer (samples are never split, so a single sample longer than ``shard_tokens`` gets its own
    shard). ``buffered_tokens`` / ``max_buffered_tokens`` expose that bound.
    """

    def __init__(
        self,
        out_dir: str | Path,
        meta: Mapping[str, Any],
        shard_tokens: int,
        input_dtype: str | torch.dtype = "bfloat16",
        logits_dtype: str | torch.dtype = "float32",
        sample_offset: int = 0,
        pre_attention: bool = False,
    ) -> None:
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise SpecPrefetchError(f"trace meta for {out_dir} lacks {', '.join(missing)}")
        if int(shard_tokens) < 1:
            raise SpecPrefetchError(f"invalid traces.shard_tokens {shard_tokens!r}: must be >= 1")
        self.out_dir = Path(out_dir)
        self.meta = dict(meta)
        self.routers: dict[str, torch.Tensor] | None = None
        if "routers" in self.meta:
            self.set_routers(self.meta.pop("routers"))
        self.shard_tokens = int(shard_tokens)
        self.input_dtype = (input_dtype if isinstance(input_dtype, torch.dtype)
                            else dtype_from_name(input_dtype, INPUT_DTYPES, "traces.input_dtype"))
        self.logits_dtype = (logits_dtype if isinstance(logits_dtype, torch.dtype)
                             else dtype_from_name(logits_dtype, LOGITS_DTYPES, "traces.logits_dtype"))
        self.pre_attention = bool(pre_attention)
        self.layer_keys = layer_keys(self.pre_attention)
        self.n_layers = len(self.meta["moe_layers"])
        self.n_experts = int(self.meta["n_experts"])
        self.top_k = int(self.meta["top_k"])
        self.hidden_size = int(self.meta["hidden_size"])
        self._buffer: list[dict[str, torch.Tensor]] = []
        self.buffered_tokens = 0
        self.max_buffered_tokens = 0
        self.sample_offset = int(sample_offset)  # a scatter shard's first sample: sample_index stays workload-global
        self.n_samples = 0
        self.n_tokens = 0
        self.n_image_tokens = 0
        self.n_prompt_tokens = 0
        self._shards: list[dict[str, Any]] = []
        self._cm: Any = None
        self._tmp: Path | None = None

    # -- context management: the directory exists under its final name only after a clean exit
    def __enter__(self) -> TraceWriter:
        self._cm = atomic_path(self.out_dir, is_dir=True)
        self._tmp = self._cm.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc_type is None:
            try:
                self._finalize()
            except BaseException:
                self._cm.__exit__(*sys.exc_info())
                raise
            self._cm.__exit__(None, None, None)
            log.info("wrote trace %s: %d samples, %d tokens, %d shards",
                     self.out_dir, self.n_samples, self.n_tokens, len(self._shards))
        else:
            self._buffer.clear()
            self._cm.__exit__(exc_type, exc, tb)
            log.warning("trace %s not written (%s)", self.out_dir, exc_type.__name__)
        return False

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    def set_routers(self, routers: Mapping[str, torch.Tensor]) -> None:
        """Gate parameters: ``gate.{i}.weight`` [n, D] (+ optional bias / correction bias), stored as float32."""
        self.routers = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in routers.items()}

    # -- adding data
    def add_sample(
        self,
        x: Sequence[torch.Tensor],
        logits: Sequence[torch.Tensor],
        topk: Sequence[torch.Tensor],
        token_ids: torch.Tensor,
        position: torch.Tensor,
        is_image: torch.Tensor,
        is_prompt: torch.Tensor,
        pre: Sequence[torch.Tensor] | None = None,
    ) -> int:
        """Buffer one sample's valid tokens (already filtered, in sequence order); return its sample index.

        Tensors are cast to the storage dtypes and moved to CPU here, so the caller's (device) tensors
        can be freed right away. A sample with no valid tokens still consumes a sample index. ``pre`` (the
        pre-attention inputs) is required by a writer made with ``pre_attention`` and refused by any other.
        """
        if self._tmp is None:
            raise SpecPrefetchError("TraceWriter.add_sample called outside its `with` block")
        index = self.sample_offset + self.n_samples
        t = int(token_ids.shape[0])
        if (pre is not None) != self.pre_attention:
            raise SpecPrefetchError(f"trace {self.out_dir}, sample {index}: pre-attention inputs "
                                    f"{'missing' if pre is None else 'given'}, but the trace "
                                    f"{'stores' if self.pre_attention else 'does not store'} them")
        per_layer = {"x": x, "logits": logits, "topk": topk, **({PRE_KEY: pre} if pre is not None else {})}
        self._check_sample(index, per_layer, token_ids, position, is_image, is_prompt)
        self.n_samples += 1
        if t == 0:
            return index
        if self.buffered_tokens and self.buffered_tokens + t > self.shard_tokens:
            self._flush()
        entry: dict[str, torch.Tensor] = {}
        dtypes = {"x": self.input_dtype, "logits": self.logits_dtype, "topk": TOPK_DTYPE, PRE_KEY: self.input_dtype}
        for i in range(self.n_layers):
            for key, seq in per_layer.items():
                entry[f"{key}.{i}"] = seq[i].detach().to("cpu", dtypes[key])
        entry["token_ids"] = token_ids.detach().to("cpu", torch.int64)
        entry["sample_index"] = torch.full((t,), index, dtype=torch.int64)
        entry["position"] = position.detach().to("cpu", torch.int32)
        entry["is_image"] = is_image.detach().to("cpu", torch.uint8)
        entry["is_prompt"] = is_prompt.detach().to("cpu", torch.uint8)
        self._buffer.append(entry)
        self.buffered_tokens += t
        self.n_tokens += t
        self.n_image_tokens += int(entry["is_image"].sum())
        self.n_prompt_tokens += int(entry["is_prompt"].sum())
        self.max_buffered_tokens = max(self.max_buffered_tokens, self.buffered_tokens)
        if self.buffered_tokens >= self.shard_tokens:
            self._flush()
        return index

    def _check_sample(self, index: int, per_layer: Mapping[str, Sequence[torch.Tensor]],
                      *per_token: torch.Tensor) -> None:
        """Reject a sample whose shapes disagree with the meta, naming the tensor: a silent mismatch would
        corrupt every predictor trained on the trace."""
        where = f"trace {self.out_dir}, sample {index}"
        for name, seq in per_layer.items():
            if len(seq) != self.n_layers:
                raise SpecPrefetchError(f"{where}: {name} has {len(seq)} layers, expected {self.n_layers}")
        if per_token[0].dim() != 1:
            raise SpecPrefetchError(f"{where}: token_ids has shape {tuple(per_token[0].shape)}, expected [T]")
        t = int(per_token[0].shape[0])
        expect = {"x": (t, self.hidden_size), "logits": (t, self.n_experts), "topk": (t, self.top_k),
                  PRE_KEY: (t, self.hidden_size)}
        for name, seq in per_layer.items():
            for i, v in enumerate(seq):
                if tuple(v.shape) != expect[name]:
                    raise SpecPrefetchError(
                        f"{where}: {name}.{i} has shape {tuple(v.shape)}, expected {expect[name]}")
        for name, v in zip(("token_ids", "position", "is_image", "is_prompt"), per_token):
            if tuple(v.shape) != (t,):
                raise SpecPrefetchError(f"{where}: {name} has shape {tuple(v.shape)}, expected ({t},)")

    # -- writing
    def _flush(self) -> None:
        if not self._buffer:
            return
        assert self._tmp is not None
        keys = list(self._buffer[0])
        tensors = {k: torch.cat([e[k] for e in self._buffer]).contiguous() for k in keys}
        n_samples = len(self._buffer)
        self._buffer.clear()
        name = shard_name(len(self._shards))
        path = self._tmp / name
        # one key: safetensors orders metadata by hash
        st_save_file(tensors, str(path), metadata={"format": TRACE_FORMAT})
        n = int(tensors["token_ids"].shape[0])
        self._shards.append({"file": name, "n_tokens": n, "n_samples": n_samples,
                             "bytes": path.stat().st_size, "sha256": sha256_file(path)})
        log.debug("flushed %s: %d tokens, %d samples", name, n, n_samples)
        self.buffered_tokens = 0

    def _finalize(self) -> None:
        assert self._tmp is not None
        self._flush()
        if self.routers is None:
            raise SpecPrefetchError(f"trace {self.out_dir}: no router weights (pass meta['routers'] or set_routers)")
        for i in range(self.n_layers):
            w = self.routers.get(f"gate.{i}.weight")
            if w is None or tuple(w.shape) != (self.n_experts, self.hidden_size):
                got = None if w is None else tuple(w.shape)
                raise SpecPrefetchError(f"trace {self.out_dir}: router gate.{i}.weight has shape {got}, "
                                        f"expected {(self.n_experts, self.hidden_size)}")
        routers_path = self._tmp / ROUTERS
        st_save_file(self.routers, str(routers_path), metadata={"format": TRACE_FORMAT})
        manifest = {
            "format": TRACE_FORMAT,
            **{k: v for k, v in self.meta.items() if k != "provenance"},
            "moe_layers": [int(v) for v in self.meta["moe_layers"]],
            "n_moe_layers": self.n_layers,
            "n_tokens": self.n_tokens,
            "n_samples": self.n_samples,
            "sample_offset": self.sample_offset,
            "n_image_tokens": self.n_image_tokens,
            "n_prompt_tokens": self.n_prompt_tokens,
            "shard_tokens": self.shard_tokens,
            "dtypes": {"x": dtype_name(self.input_dtype), "logits": dtype_name(self.logits_dtype),
                       "topk": dtype_name(TOPK_DTYPE), **{k: dtype_name(d) for k, d in TOKEN_KEYS.items()},
                       **({PRE_KEY: dtype_name(self.input_dtype)} if self.pre_attention else {})},
            "shards": self._shards,
            "routers": {"file": ROUTERS, "bytes": routers_path.stat().st_size, "sha256": sha256_file(routers_path),
                        "keys": sorted(self.routers)},
            "provenance": self.meta.get("provenance", {}),
        }
        write_json_atomic(self._tmp / MANIFEST, manifest)


# --------------------------------------------------------------------------------------------- reader


class TraceReader:
    """Read a trace directory, checking every file against the manifest before any tensor is used.

    ``verify=True`` hashes each shard (streamed) just before loading it;
    with ``verify=False`` only sizes, keys, shapes and dtypes are checked.
    """

    def __init__(self, trace_dir: str | Path, verify: bool = True) -> None:
        self.dir = Path(trace_dir)
        self.verify = verify
        path = self.dir / MANIFEST
        if not path.is_file():
            raise TraceError(f"{path}: missing; {self.dir} is not a complete trace (extraction did not finish)")
        self.manifest: dict[str, Any] = read_doc(path, None, "trace manifest")
        self._check_manifest(path)
        self._dtypes = {k: dtype_from_name(v, (*INPUT_DTYPES, "int32", "int64", "uint8"), f"{path} dtypes.{k}")
                        for k, v in self.manifest["dtypes"].items()}
        # the per-layer tensors of every shard (and batch): the pre-attention inputs where the trace stores them
        self.layer_keys = layer_keys(PRE_KEY in self._dtypes)

    @property
    def has_pre_attention(self) -> bool:
        """The trace stores each MoE layer's pre-attention input (``pre.{i}``)."""
        return PRE_KEY in self.layer_keys

    def _check_manifest(self, path: Path) -> None:
        m = self.manifest
        if m.get("format") != TRACE_FORMAT:
            raise TraceError(f"{path}: format {m.get('format')!r}, expected {TRACE_FORMAT!r}")
        need = (*REQUIRED_META, "n_moe_layers", "n_tokens", "n_samples", "dtypes", "shards")
        missing = [k for k in need if k not in m]
        if missing:
            raise TraceError(f"{path}: missing keys {', '.join(missing)}")
        for key in ("n_moe_layers", "n_tokens", "n_samples", "n_experts", "top_k", "hidden_size"):
            require(m, key, int, str(path))
        require(m, "moe_layers", list, str(path))
        require(m, "dtypes", dict, str(path))
        if not all(isinstance(v, str) for v in m["dtypes"].values()):
            raise TraceError(f"{path}: dtypes must map tensor names to dtype names")
        if "routers" in m and not isinstance(m["routers"], dict):
            raise TraceError(f"{path}: routers must be a mapping")
        if not isinstance(m["shards"], list) or not all(isinstance(e, dict) for e in m["shards"]):
            raise TraceError(f"{path}: shards must be a list of mappings")
        for j, entry in enumerate([*m["shards"], *([m["routers"]] if "routers" in m else [])]):
            where = f"{path} shards[{j}]" if j < len(m["shards"]) else f"{path} routers"
            require(entry, "file", str, where)
            require(entry, "bytes", int, where)
            if j < len(m["shards"]):
                require(entry, "n_tokens", int, where)
            self.path_of(entry)  # a plain file name inside the trace directory, or an error
        self._check_values(path)
        if sum(s["n_tokens"] for s in m["shards"]) != m["n_tokens"]:
            raise TraceError(f"{path}: shard token counts do not add up to n_tokens={m['n_tokens']}")
        if len(m["moe_layers"]) != m["n_moe_layers"]:
            raise TraceError(f"{path}: moe_layers has {len(m['moe_layers'])} entries, n_moe_layers={m['n_moe_layers']}")

    def _check_values(self, path: Path) -> None:
        """Counts that a metric divides by are > 0 (an empty trace is not a verified one), K fits the experts,
        layer indices and sizes are >= 0."""
        m = self.manifest
        with reraise_as(TraceError):
            for key in ("n_moe_layers", "n_tokens", "n_samples", "n_experts", "top_k", "hidden_size"):
                finite(m[key], str(path), key, integer=True, positive=True)
            if m["top_k"] > m["n_experts"]:
                raise TraceError(f"{path}: top_k={m['top_k']} > n_experts={m['n_experts']}")
            if not m["shards"]:
                raise TraceError(f"{path}: lists no shards (an empty trace: extraction wrote no token)")
            for j, entry in enumerate(m["shards"]):
                finite(entry["n_tokens"], f"{path} shards[{j}]", "n_tokens", integer=True, positive=True)
                finite(entry["bytes"], f"{path} shards[{j}]", "bytes", integer=True, positive=True)
            for j, layer in enumerate(m["moe_layers"]):
                finite(layer, f"{path} moe_layers[{j}]", "layer", integer=True, lo=0)

    def path_of(self, entry: Mapping[str, Any]) -> Path:
        """The file a manifest entry names, confined to the trace directory (no ``..``, no absolute path)."""
        return member(self.dir, entry.get("file"), f"trace manifest {MANIFEST}")

    # -- manifest shortcuts
    @property
    def n_layers(self) -> int:
        return int(self.manifest["n_moe_layers"])

    @property
    def n_experts(self) -> int:
        return int(self.manifest["n_experts"])

    @property
    def top_k(self) -> int:
        return int(self.manifest["top_k"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    # -- file access
    def check_sizes(self) -> None:
        """Every listed file exists with the manifest's size (cheap: catches missing and truncated files; the
        sha256 of each is checked when it is read, or by ``verify_all``)."""
        for entry in [*self.manifest["shards"], *([self.manifest["routers"]] if "routers" in self.manifest else [])]:
            path = self.path_of(entry)
            if not path.is_file():
                raise TraceError(f"{path}: missing (listed in {self.dir / MANIFEST})")
            if path.stat().st_size != entry["bytes"]:
                raise TraceError(f"{path}: {path.stat().st_size} bytes, manifest says {entry['bytes']} "
                                 "(truncated or rewritten)")

    def _read_checked(self, entry: Mapping[str, Any], verify: bool) -> dict[str, torch.Tensor]:
        """Load one file listed in the manifest; size, then (optionally) sha256, then parse."""
        path = self.path_of(entry)
        if not path.is_file():
            raise TraceError(f"{path}: missing (listed in {self.dir / MANIFEST})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise TraceError(f"{path}: {size} bytes, manifest says {entry['bytes']} (truncated or rewritten)")
        try:
            if verify:
                digest = sha256_file(path)  # streamed: memory stays at one shard, not two
                if digest != entry["sha256"]:
                    raise TraceError(f"{path}: sha256 {digest[:12]}... does not match the manifest "
                                     f"({entry['sha256'][:12]}...): the file is corrupt")
            return st_load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(f"{path}: unreadable safetensors file ({exc})") from None

    def _check_shard(self, entry: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> None:
        """Shapes and dtypes must match the manifest: a mismatched shard would silently misalign layers."""
        path = self.path_of(entry)
        n = int(entry["n_tokens"])
        expect: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for i in range(self.n_layers):
            expect[f"x.{i}"] = ((n, self.hidden_size), self._dtypes["x"])
            expect[f"logits.{i}"] = ((n, self.n_experts), self._dtypes["logits"])
            expect[f"topk.{i}"] = ((n, self.top_k), self._dtypes["topk"])
            if self.has_pre_attention:
                expect[f"{PRE_KEY}.{i}"] = ((n, self.hidden_size), self._dtypes[PRE_KEY])
        for k in TOKEN_KEYS:
            expect[k] = ((n,), self._dtypes[k])
        missing = sorted(set(expect) - set(t))
        if missing:
            raise TraceError(f"{path}: missing tensors {', '.join(missing[:5])}")
        for k, (shape, dtype) in expect.items():
            if tuple(t[k].shape) != shape or t[k].dtype != dtype:
                raise TraceError(f"{path}: {k} is {tuple(t[k].shape)} {dtype_name(t[k].dtype)}, "
                                 f"manifest implies {shape} {dtype_name(dtype)}")
        for i in range(self.n_layers):  # ids must index an expert; inputs and logits must be numbers
            tk = t[f"topk.{i}"]
            if tk.numel() and (int(tk.min()) < 0 or int(tk.max()) >= self.n_experts):
                bad = int(tk.min()) if int(tk.min()) < 0 else int(tk.max())
                raise TraceError(f"{path}: topk.{i} holds expert id {bad}, outside [0, {self.n_experts})")
        with reraise_as(TraceError):
            check_finite_tensors({k: t[k] for k in expect if k.startswith(("x.", "logits.", f"{PRE_KEY}."))},
                                 str(path))

    def read_shard(self, j: int) -> dict[str, torch.Tensor]:
        """Shard ``j``'s tensors (keys as in the file), after checking size, sha256, shapes and dtypes."""
        entry = self.manifest["shards"][j]
        tensors = self._read_checked(entry, self.verify)
        self._check_shard(entry, tensors)
        return tensors

    def iter_shards(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each shard's tensors, in order, after checking it."""
        for j in range(len(self.manifest["shards"])):
            yield self.read_shard(j)

    def routers(self, verify: bool | None = None) -> dict[str, torch.Tensor]:
        """All gate parameters stored with the trace (``gate.{i}.weight`` etc.), float32."""
        entry = self.manifest.get("routers") or {"file": ROUTERS}
        path = self.path_of(entry)
        if "sha256" in entry:
            tensors = self._read_checked(entry, self.verify if verify is None else verify)
        else:
            tensors = load_safetensors(path, "the trace's router weights")
        for i in range(self.n_layers):
            w = tensors.get(f"gate.{i}.weight")
            if w is None or tuple(w.shape) != (self.n_experts, self.hidden_size):
                raise TraceError(f"{path}: gate.{i}.weight missing or not {(self.n_experts, self.hidden_size)}")
        return tensors

    def gate_weights(self) -> list[torch.Tensor]:
        """The routers' weight matrices [n, D], one per MoE layer ordinal (what FATE applies)."""
        r = self.routers()
        return [r[f"gate.{i}.weight"] for i in range(self.n_layers)]

    def verify_all(self) -> dict[str, Any]:
        """Hash and parse every file; raise one TraceError naming all bad files, else return a summary."""
        bad: list[str] = []
        for entry in self.manifest["shards"]:
            try:
                self._check_shard(entry, self._read_checked(entry, True))
            except TraceError as exc:
                bad.append(str(exc))
        try:
            self.routers(verify=True)
        except TraceError as exc:
            bad.append(str(exc))
        if bad:
            raise TraceError(f"{self.dir}: {len(bad)} bad file(s):\n  " + "\n  ".join(bad))
        return {"dir": str(self.dir), "shards": len(self.manifest["shards"]), "n_tokens": self.n_tokens,
                "n_samples": self.manifest["n_samples"], "ok": True}

    # -- batching
    def iter_batches(self, batch_tokens: int, shuffle: bool = False, seed: int = 0,
                     drop_last: bool = False) -> Iterator[dict[str, Any]]:
        """Yield batches of ``batch_tokens`` tokens (the last may be short unless ``drop_last``).

        Streams one shard at a time (memory: one shard plus one batch). With ``shuffle`` the shard
        order is permuted and tokens are permuted within each shard, both from ``seed``: a stream
        shuffle, not a global one, which is what bounded memory allows. Every token appears exactly once.
        Batch keys: ``x``, ``logits``, ``topk`` (lists over MoE layer ordinals, stored dtypes) and the
        per-token tensors ``token_ids``, ``sample_index``, ``position``, ``is_image``, ``is_prompt``.
        """
        if batch_tokens < 1:
            raise SpecPrefetchError(f"invalid batch_tokens {batch_tokens}: must be >= 1")
        gen = torch.Generator().manual_seed(int(seed))
        entries = list(self.manifest["shards"])
        order = torch.randperm(len(entries), generator=gen).tolist() if shuffle else range(len(entries))
        carry: dict[str, torch.Tensor] | None = None
        for j in order:
            entry = entries[j]
            flat = self._read_checked(entry, self.verify)
            self._check_shard(entry, flat)
            n = int(entry["n_tokens"])
            if shuffle:
                perm = torch.randperm(n, generator=gen)
                flat = {k: v[perm] for k, v in flat.items()}
            start = 0
            if carry is not None:
                need = batch_tokens - int(carry["token_ids"].shape[0])
                take = min(need, n)
                carry = {k: torch.cat([carry[k], flat[k][:take]]) for k in carry}
                start = take
                if int(carry["token_ids"].shape[0]) == batch_tokens:
                    yield self._to_batch(carry)
                    carry = None
                else:
                    continue
            while start + batch_tokens <= n:
                yield self._to_batch({k: v[start:start + batch_tokens] for k, v in flat.items()})
                start += batch_tokens
            if start < n:
                carry = {k: v[start:].clone() for k, v in flat.items()}
            del flat
        if carry is not None and not drop_last:
            yield self._to_batch(carry)

    def n_batches(self, batch_tokens: int, drop_last: bool = False) -> int:
        """How many batches ``iter_batches`` yields (for progress bars and LR schedules)."""
        return self.n_tokens // batch_tokens if drop_last else math.ceil(self.n_tokens / batch_tokens)

    def _to_batch(self, flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        batch: dict[str, Any] = {key: [flat[f"{key}.{i}"] for i in range(self.n_layers)] for key in self.layer_keys}
        batch.update({k: flat[k] for k in TOKEN_KEYS})
        return batch


# --------------------------------------------------------------------------------------------- scatter / gather

# Manifest keys every scatter shard of one trace set must share (anything else would misalign the gathered trace).
SHARED_KEYS = (*REQUIRED_META, "mode", "n_moe_layers", "shard_tokens", "dtypes")


def scatter_range(n_samples: int, index: int, count: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of scatter shard ``index`` of ``count``: contiguous, sizes differing by at most one."""
    if count < 1 or not 0 <= index < count:
        raise SpecPrefetchError(f"invalid scatter shard {index} of {count}")
    return index * n_samples // count, (index + 1) * n_samples // count


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link (no second copy of a large trace), copying where links are impossible (another filesystem)."""
    try:
        dst.hardlink_to(src)
    except OSError:
        shutil.copyfile(src, dst)


def _samples_of(reader: TraceReader) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(sample_index, its tokens' tensors) of every sample with tokens, in order."""
    for shard in reader.iter_shards():
        sidx = shard["sample_index"]
        bounds = [0, *((sidx[1:] != sidx[:-1]).nonzero().flatten() + 1).tolist(), int(sidx.shape[0])]
        for a, b in zip(bounds, bounds[1:]):
            yield int(sidx[a]), {k: v[a:b] for k, v in shard.items()}


def _scatter_set(shard_dirs: Sequence[str | Path]) -> tuple[list[TraceReader], list[dict[str, Any]]]:
    """Open the shards of one trace set and check they can be joined; return readers and manifests in shard order.

    They must be shards 0..N-1 of the same N, share model, workload, layers, dtypes and routers, and cover
    consecutive samples: anything else (a missing or repeated shard, shards of another run) is named here, before
    anything is written.
    """
    readers = [TraceReader(d, verify=True) for d in shard_dirs]
    if not readers:
        raise SpecPrefetchError("gather_traces: no shard directories")
    mans = [r.manifest for r in readers]
    where = [str(Path(d) / MANIFEST) for d in shard_dirs]
    count = {m.get("scatter", {}).get("count", 1) for m in mans}
    indices = [m.get("scatter", {}).get("index", 0) for m in mans]
    if len(count) != 1 or sorted(indices) != list(range(count.pop())) or len(mans) != len(set(indices)):
        raise TraceError(f"gather_traces: scatter shards {indices} of {[m.get('scatter') for m in mans]} are not "
                         f"shards 0..N-1 of one N ({', '.join(where)})")
    order = sorted(range(len(mans)), key=lambda i: indices[i])
    readers, mans, where = [readers[i] for i in order], [mans[i] for i in order], [where[i] for i in order]
    first = mans[0]
    for m, w in zip(mans[1:], where[1:], strict=True):
        for k in SHARED_KEYS:
            if m.get(k) != first.get(k):
                raise TraceError(f"{w}: {k}={m.get(k)!r} differs from {where[0]} ({first.get(k)!r})")
        if m["routers"]["sha256"] != first["routers"]["sha256"]:
            raise TraceError(f"{w}: router weights differ from {where[0]} (shards of different checkpoints?)")
    expected_offset = int(first.get("sample_offset", 0))
    for m, w in zip(mans, where, strict=True):
        if int(m.get("sample_offset", 0)) != expected_offset:
            raise TraceError(f"{w}: sample_offset {m.get('sample_offset')} but the previous shards end at sample "
                             f"{expected_offset} (a missing or duplicated range of samples)")
        expected_offset += int(m["n_samples"])
    return readers, mans


def _link_whole(reader: TraceReader, gathered_from: list[dict[str, Any]], out_dir: str | Path) -> None:
    """One shard is the whole trace: hard-link its files as they are (every file is hashed first, since nothing
    reads them) and write only a new manifest, without the scatter and with where it came from."""
    reader.verify_all()
    first = reader.manifest
    with atomic_path(out_dir, is_dir=True) as tmp:
        for entry in first["shards"]:
            _link_or_copy(reader.path_of(entry), tmp / entry["file"])
        _link_or_copy(reader.dir / ROUTERS, tmp / ROUTERS)
        manifest = {k: v for k, v in first.items() if k != "scatter"}
        manifest["provenance"] = {**first.get("provenance", {}), "gathered_from": gathered_from}
        write_json_atomic(tmp / MANIFEST, manifest)


def _replay_shards(readers: list[TraceReader], mans: list[dict[str, Any]], gathered_from: list[dict[str, Any]],
                   out_dir: str | Path) -> None:
    """Replay the shards' samples in order through one fresh :class:`TraceWriter`, so the output has the shard
    boundaries one job would have written; samples without tokens (within and after the shards) are re-added
    empty, so sample indices stay workload-global."""
    first = mans[0]
    written_by_the_writer = ("format", "scatter", "shards", "routers", "dtypes", "n_moe_layers", "n_tokens",
                             "n_samples", "sample_offset", "n_image_tokens", "n_prompt_tokens", "shard_tokens",
                             "provenance", "n_truncated")
    meta = {k: v for k, v in first.items() if k not in written_by_the_writer}
    meta["provenance"] = {**first.get("provenance", {}), "gathered_from": gathered_from}
    n_layers = int(first["n_moe_layers"])
    with TraceWriter(out_dir, meta, int(first["shard_tokens"]), first["dtypes"]["x"], first["dtypes"]["logits"],
                     sample_offset=int(first.get("sample_offset", 0)),
                     pre_attention=readers[0].has_pre_attention) as writer:
        writer.set_routers(readers[0].routers())
        for r in readers:
            for index, t in _samples_of(r):
                while writer.sample_offset + writer.n_samples < index:  # samples without valid tokens
                    _add_empty(writer)
                writer.add_sample(**{k: [t[f"{k}.{i}"] for i in range(n_layers)] for k in writer.layer_keys},
                                  token_ids=t["token_ids"], position=t["position"], is_image=t["is_image"],
                                  is_prompt=t["is_prompt"])
        while writer.n_samples < sum(int(m["n_samples"]) for m in mans):  # trailing samples without tokens
            _add_empty(writer)
        if all("n_truncated" in m for m in mans):
            writer.meta["n_truncated"] = sum(int(m["n_truncated"]) for m in mans)


def gather_traces(shard_dirs: Sequence[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """Join the scatter shards of one trace set (``extract-traces --shard I/N``) into one trace directory.

    Every file is verified (sha256: as it is read, or up front for a hard link); they must be shards 0..N-1 of the
    same N, share model, workload, layers, dtypes and routers, and cover consecutive samples. The samples are
    replayed in order through a fresh :class:`TraceWriter`, so the result is the trace one job would have written,
    file for file (the same shard boundaries, hence the same shuffled training order: results do not depend on
    ``traces.scatter``); a single shard is hard-linked as it is. The manifest is written last, atomically. Returns
    the trace's stats.
    """
    readers, mans = _scatter_set(shard_dirs)
    gathered_from = [{"dir": str(r.dir), "scatter": m.get("scatter"), "manifest_sha256": sha256_file(r.dir / MANIFEST)}
                     for r, m in zip(readers, mans, strict=True)]
    if len(readers) == 1:
        _link_whole(readers[0], gathered_from, out_dir)
    else:
        _replay_shards(readers, mans, gathered_from, out_dir)
    log.info("gathered %d scatter shard(s) into %s", len(mans), out_dir)
    return trace_stats(out_dir)


def _add_empty(writer: TraceWriter) -> None:
    e = torch.empty(0, dtype=torch.int64)
    writer.add_sample([torch.empty(0, writer.hidden_size)] * writer.n_layers,
                      [torch.empty(0, writer.n_experts)] * writer.n_layers,
                      [torch.empty(0, writer.top_k, dtype=torch.int64)] * writer.n_layers,
                      token_ids=e, position=e, is_image=e, is_prompt=e,
                      pre=[torch.empty(0, writer.hidden_size)] * writer.n_layers if writer.pre_attention else None)


# --------------------------------------------------------------------------------------------- stats


def trace_stats(trace_dir: str | Path) -> dict[str, Any]:
    """Size and composition of a trace, from its manifest (no shard is read or hashed).

    ``bytes_per_token`` is measured on disk (all shards / tokens); ``bytes_per_token_per_layer`` is the
    per-layer payload (x + logits + topk) implied by the dtypes, i.e. what one more MoE layer costs.
    """
    reader = TraceReader(trace_dir, verify=False)
    m = reader.manifest
    reader.check_sizes()
    n_tok = max(reader.n_tokens, 1)
    if "n_image_tokens" in m and "n_prompt_tokens" in m:
        n_img, n_prompt = int(m["n_image_tokens"]), int(m["n_prompt_tokens"])
    else:  # a manifest without the writer's counts: scan the flags
        n_img = n_prompt = 0
        for shard in reader.iter_shards():
            n_img += int(shard["is_image"].sum())
            n_prompt += int(shard["is_prompt"].sum())
    shard_bytes = sum(int(s["bytes"]) for s in m["shards"])
    item = {k: torch.empty((), dtype=d).element_size() for k, d in reader._dtypes.items()}
    per_layer = (reader.hidden_size * item["x"] + reader.n_experts * item["logits"] + reader.top_k * item["topk"]
                 + (reader.hidden_size * item[PRE_KEY] if reader.has_pre_attention else 0))
    per_token_meta = sum(item[k] for k in TOKEN_KEYS)
    return {
        "dir": str(reader.dir),
        "model": m["model"],
        "workload": m["workload"],
        "n_samples": m["n_samples"],
        "n_tokens": reader.n_tokens,
        "n_shards": len(m["shards"]),
        "n_moe_layers": reader.n_layers,
        "bytes_shards": shard_bytes,
        "bytes_routers": int((m.get("routers") or {}).get("bytes", 0)),
        "bytes_per_token": shard_bytes / n_tok,
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token_metadata": per_token_meta,
        "image_token_share": n_img / n_tok,
        "prompt_token_share": n_prompt / n_tok,
        "dtypes": m["dtypes"],
    }
