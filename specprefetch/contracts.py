"""The one boundary every file the pipeline reads goes through.

Each reader turns the ways a file can be bad — missing, a directory, unreadable, binary, not UTF-8, not parseable,
the wrong document, a missing key, a name that escapes its directory — into one ``SpecPrefetchError`` line
``file[:line]: what is wrong``, which the CLI prints and exits 2 on. Nothing here unpickles: tensors are read
from safetensors only (``load_safetensors``, ``load_tensor_tree``).

Documents: ``read_text`` → ``read_doc`` (JSON or YAML, duplicate keys rejected, format string and required keys
checked); tables: ``read_csv`` (pandas) and ``csv_rows`` (the csv module, with line numbers); lines: ``read_jsonl``;
names inside manifests: ``member``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from specprefetch import registry
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.registry import NameView, Policy, TableView

if TYPE_CHECKING:
    import pandas as pd
    import torch

# CSV fields of our artefacts are short; a log with a multi-megabyte cell is malformed, and the csv module's default
# limit (128 KiB) raises a bare ``_csv.Error`` mid-read. Raised once here, reported as one line by csv_rows.
CSV_FIELD_LIMIT = 1 << 20
csv.field_size_limit(CSV_FIELD_LIMIT)


# Vocabularies of the device stage: the runtime, its config section, runs.csv and the external-log schema. Each is a
# live view of its registry (specprefetch.registry), where every name is written once.
POLICY: Mapping[str, Policy] = TableView(registry.policies, "runtime policy")
POLICIES: Sequence[str] = NameView(registry.policies, "runtime policy")
PREDICTING: Sequence[str] = NameView(lambda: [p for p, pol in registry.policies().items() if pol.predicts], "policy")
STORAGES: Sequence[str] = NameView(registry.storages, "storage")
EMULATED: Sequence[str] = NameView(lambda: [s for s, st in registry.storages().items() if st.emulated], "storage")
METHODS: Sequence[str] = NameView(registry.methods, "predictor method")
EXPERIMENTS = ("main", "matched", "sweep", "storage", "component", "budget", "lookahead", "pre_attention", "batch")
# A variant's runs (device.variants: the same experiment under another emulation or I/O order) are named
# "<experiment>@<variant>" in runs.csv, so every reader of an experiment sees the default's runs only.
VARIANT_NAME = r"[a-z][a-z0-9_]*"


def variant_experiment(experiment: str, variant: str | None) -> str:
    """runs.csv's ``experiment`` of ``experiment`` measured in ``variant`` (None: the default)."""
    return f"{experiment}@{variant}" if variant else experiment


def split_experiment(name: str) -> tuple[str, str | None]:
    """The inverse of :func:`variant_experiment`: (experiment, variant or None)."""
    base, _, variant = name.partition("@")
    return base, variant or None
# latency.csv: the per-layer breakdown of Figure 1(a)
LATENCY_MODES = ("resident", "on_demand")
REALISM_TOKEN_TYPES = ("all", "text", "image")  # the realism table's token split (traces' is_image flag)
LATENCY_PARTS = ("attention", "router", "expert_load", "moe_compute", "other")

# The format string of every artefact (its manifest's or document's ``format``); a reader accepts only its own.
WORKLOAD_FORMAT = "specprefetch-workload/1"          # results/workloads/<w>/manifest.json, results/corpus/
STANDIN_FORMAT = "specprefetch-standin/2"            # results/models/<m>/specprefetch_model.json (weights' sha256)
TRACE_FORMAT = "specprefetch-trace/1"                # results/traces/<m>/<w>/manifest.json (and trace shards)
PREDICTOR_FORMAT = "specprefetch-predictor/1"        # results/predictors/<m>/<method>/meta.json
STORE_FORMAT = "specprefetch-expert-store/2"         # results/device/store/<m>/manifest.json
ROUTING_FORMAT = "specprefetch-routing-record/2"     # results/device/measured/<m>.routing.safetensors (tensor tree)
TABLE_FORMAT = "specprefetch-table/1"                # paper_tables/<table>.json, figures/<figure>.json


class ContractError(SpecPrefetchError):
    """A file does not hold what its reader expects; the message names the file (and line)."""


@contextlib.contextmanager
def reraise_as(error: type[SpecPrefetchError]) -> Iterator[None]:
    """Inside the block, a ContractError becomes ``error`` (same one line): a reader keeps its own error type."""
    try:
        yield
    except ContractError as exc:
        if isinstance(exc, error):
            raise
        raise error(str(exc)) from None


# ------------------------------------------------------------------------------------------------ raw text
def _os_reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    path = regular_file(path, what)  # a FIFO, device, loop or over-long path is refused before open
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ContractError(f"{path}: cannot read {what} ({_os_reason(exc)})") from None


def decode_text(data: bytes, where: str, what: str) -> str:
    """UTF-8 (a leading byte-order mark is accepted and dropped); binary content is named as such."""
    if b"\x00" in data:
        raise ContractError(f"{where}: binary file, expected {what} (UTF-8 text)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ContractError(f"{where}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                            f"{what} must be UTF-8") from None


def read_text(path: str | os.PathLike, what: str) -> str:
    return decode_text(read_bytes(path, what), str(path), what)


# ------------------------------------------------------------------------------------------------ documents
class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last one silently)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key == "<<":  # merge keys may repeat by design
            continue
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # unhashable key: let SafeLoader report it
            continue
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {first})", key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def parse_yaml(text: str, where: str) -> Any:
    loader = _UniqueKeyLoader(text)  # a SafeLoader subclass
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        yaml_expanded_size(node, where)  # aliases bounded before anything is constructed
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ContractError(f"{where}{line}: not valid YAML ({problem})") from None
    finally:
        loader.dispose()


def _unique_pairs(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ContractError(f"{where}: duplicate key {k!r}")
            out[k] = v
        return out

    return hook


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs(where))
    except json.JSONDecodeError as exc:
        raise ContractError(f"{where}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ContractError(f"{where}: JSON nested too deeply") from None


def read_doc(path: str | os.PathLike, fmt: str | None, what: str, required: Sequence[str] = (),
             kind: str | None = None) -> dict[str, Any]:
    """A JSON or YAML mapping (``kind`` from the suffix unless given), checked before any value is used.

    ``fmt``: the required value of its ``format`` key (None: no format key). ``required``: keys it must have.
    """
    path = Path(path)
    kind = kind or ("yaml" if path.suffix in (".yaml", ".yml") else "json")
    text = read_text(path, what)
    doc = parse_yaml(text, str(path)) if kind == "yaml" else parse_json(text, str(path))
    if not isinstance(doc, dict):
        raise ContractError(f"{path}: {what} must be a mapping, got {type(doc).__name__}")
    if fmt is not None and doc.get("format") != fmt:
        raise ContractError(f"{path}: format {doc.get('format')!r}, expected {fmt!r} ({what})")
    missing = [k for k in required if k not in doc]
    if missing:
        raise ContractError(f"{path}: {what} lacks required key {missing[0]!r}")
    return doc


def require(mapping: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    """``mapping[key]`` of the given type(s) (bool is not an int here), or one line naming the key."""
    if key not in mapping:
        raise ContractError(f"{where}: missing key {key!r}")
    value = mapping[key]
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ContractError(f"{where}: key {key!r} must be {names}, got {type(value).__name__} {value!r:.60}")
    return value


# ------------------------------------------------------------------------------------------------ lines, tables
def read_jsonl(path: str | os.PathLike, what: str, skip_blank: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (``file:line``, object) for each line; a line that is not one JSON object is an error."""
    path = Path(path)
    text = read_text(path, what)
    for i, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{i}"
        if not line.strip():
            if skip_blank:
                continue
            raise ContractError(f"{where}: empty line (one JSON object per line expected)")
        try:
            obj = json.loads(line, object_pairs_hook=_unique_pairs(where))
        except json.JSONDecodeError as exc:
            raise ContractError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ContractError(f"{where}: a JSON object per line is expected, got {type(obj).__name__}")
        yield where, obj


def csv_rows(path: str | os.PathLike, what: str) -> Iterator[tuple[int, list[str]]]:
    """Yield (line number, cells) of a CSV file; decoding, quoting and field-size errors are one line."""
    path = Path(path)
    text = read_text(path, what)
    reader = csv.reader(text.splitlines(keepends=True))  # keepends: a quoted cell's newline is kept, not dropped
    last = 0
    try:
        for cells in reader:
            yield reader.line_num, cells
            last = reader.line_num
    except csv.Error as exc:
        raise ContractError(f"{path}:{last + 1}: malformed CSV ({exc})") from None


def read_csv(path: str | os.PathLike, columns: Sequence[str], what: str, **kwargs: Any) -> pd.DataFrame:
    """A pandas frame with at least ``columns``; an empty, truncated or malformed file is one line."""
    import io

    import pandas as pd

    path = Path(path)
    text = read_text(path, what)
    if not text.strip():
        raise ContractError(f"{path}: empty file, expected {what}")
    try:
        df = pd.read_csv(io.StringIO(text), **kwargs)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError, csv.Error) as exc:
        raise ContractError(f"{path}: malformed CSV ({str(exc).splitlines()[0]})") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ContractError(f"{path}:1: {what} lacks column {missing[0]!r}")
    return df


# ------------------------------------------------------------------------------------------------ result CSVs
@dataclass(frozen=True)
class Column:
    """One column of a CSV contract: kind is str, int, float or bool; optional allowed values and range."""

    name: str
    kind: str = "str"
    allowed: Sequence[str] | None = None
    pattern: str | None = None  # a str column's values must match this regex in full
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    nullable: bool = False
    default: str | None = None  # a column older files lack: read as this value (recall's seed: "0")



CSV_CONTRACTS: dict[str, tuple[Column, ...]] = {
    "recall": (
        Column("model"), Column("workload"), Column("method", allowed=METHODS),
        Column("seed", "int", lo=0, default="0"), Column("M", "int", lo=1),
        Column("expert_recall", "float", lo=0.0, hi=1.0), Column("n_tokens", "int", lo=0, lo_open=True),
    ),
    # results/recall/lookahead.csv (beyond the paper): recall's rows per look-ahead distance d (layer l predicts
    # layer l+d; d = 1 is the paper's, the same values as recall.csv)
    "lookahead": (
        Column("model"), Column("workload"), Column("method", allowed=METHODS), Column("seed", "int", lo=0),
        Column("lookahead", "int", lo=1), Column("M", "int", lo=1),
        Column("expert_recall", "float", lo=0.0, hi=1.0), Column("n_tokens", "int", lo=0, lo_open=True),
    ),
    "per_layer": (
        Column("model"), Column("workload"), Column("method", allowed=METHODS),
        Column("seed", "int", lo=0, default="0"), Column("M", "int", lo=1), Column("layer", "int", lo=0),
        Column("expert_recall", "float", lo=0.0, hi=1.0),
    ),
    "params": (Column("model"), Column("method", allowed=METHODS), Column("trainable_params", "int", lo=0)),
    "runs": (
        Column("platform"), Column("model"),
        Column("experiment", pattern=rf"(?:{'|'.join(EXPERIMENTS)})(?:@{VARIANT_NAME})?"),
        Column("policy", allowed=POLICIES), Column("storage", allowed=STORAGES),
        Column("m_max", "int", lo=0, nullable=True), Column("compute_opt", "bool"), Column("repeat", "int", lo=0),
        Column("tokens_per_s", "float", lo=0.0, lo_open=True), Column("ready_recall", "float", lo=0.0, hi=1.0,
                                                                        nullable=True),
        Column("source"),
    ),
    "window": (
        Column("platform"), Column("model"), Column("layer", "int", lo=0), Column("window_ms", "float", lo=0.0),
        Column("transfer_ms", "float", lo=0.0, lo_open=True), Column("m_max", "int", lo=0),
    ),
    # results/device/host.csv (runtime.measurement.window.host_rows): what the host gave the benchmarks, per storage
    "host": (
        Column("platform"), Column("model"), Column("storage"), Column("compute_ms", "float", lo=0.0),
        Column("window_ms", "float", lo=0.0), Column("transfer_ms", "float", lo=0.0, lo_open=True),
        Column("w_over_t", "float", lo=0.0), Column("m_max", "int", lo=0),
        Column("emulation", allowed=("none", "delay", "bandwidth")),
        Column("delay_ms", "float", lo=0.0),
    ),
    # results/device/budget_curve.csv (runtime.simulation.budget_model): the simulator's curves from the window
    # profile alone -- per storage its W/t and per budget its throughput; OFF and SpecPrefetch along a W/t grid
    "budget_curve": (
        Column("platform"), Column("model"), Column("emulation", allowed=("delay", "bandwidth")),
        Column("io_order", allowed=("demand_first", "fifo")),
        Column("curve", allowed=("storage", "budget", "w_over_t")), Column("storage", nullable=True),
        Column("rule", allowed=("window", "simulated"), nullable=True),
        Column("w_over_t", "float", lo=0.0, lo_open=True), Column("transfer_ms", "float", lo=0.0, lo_open=True),
        Column("m_max", "int", lo=1), Column("off_tokens_per_s", "float", lo=0.0, lo_open=True),
        Column("tokens_per_s", "float", lo=0.0, lo_open=True), Column("gain_pct", "float"),
        Column("m_max_window", "int", lo=1), Column("m_max_simulated", "int", lo=1),
    ),
    "window_events": (
        Column("platform"), Column("model"), Column("layer", "int", lo=0), Column("M", "int", lo=1),
        Column("demand_ms", "float", lo=0.0), Column("window_ms", "float", lo=0.0),
    ),
    "latency": (
        Column("platform"), Column("model"), Column("mode", allowed=LATENCY_MODES), Column("layer", "int", lo=0),
        Column("component", allowed=LATENCY_PARTS), Column("ms", "float", lo=0.0),
    ),
    # results/realism/realism.csv (traces.realism): per model, workload and token type, FATE R@K and the routing
    # properties behind it (adjacent router-input cosine, normalised expert-load entropy)
    "realism": (
        Column("model"), Column("workload"), Column("tokens", allowed=REALISM_TOKEN_TYPES), Column("M", "int", lo=1),
        Column("n_tokens", "int", lo=0, lo_open=True), Column("fate_recall", "float", lo=0.0, hi=1.0),
        Column("input_cosine", "float", lo=-1.0, hi=1.0), Column("load_entropy", "float", lo=0.0, hi=1.0),
    ),
    # results/predictors/predictor_cost.csv (predictors.cost): per model and live method, the trainable parameters
    # and the prediction time per layer pair as a ratio of one MoE layer's compute (mean over rounds, bootstrap CI)
    "predictor_cost": (
        Column("model"), Column("method", allowed=METHODS), Column("trainable_params", "int", lo=0),
        Column("layer_us", "float", lo=0.0, lo_open=True), Column("predict_us", "float", lo=0.0, lo_open=True),
        Column("ratio", "float", lo=0.0), Column("ratio_lo", "float", lo=0.0), Column("ratio_hi", "float", lo=0.0),
        Column("rounds", "int", lo=2),
    ),
}

# Column names in file order (the writers' headers); runs.csv has more columns than its contract checks.
RECALL_COLUMNS = [c.name for c in CSV_CONTRACTS["recall"]]
PER_LAYER_COLUMNS = [c.name for c in CSV_CONTRACTS["per_layer"]]
LOOKAHEAD_COLUMNS = [c.name for c in CSV_CONTRACTS["lookahead"]]
PARAM_COLUMNS = [c.name for c in CSV_CONTRACTS["params"]]
REALISM_COLUMNS = [c.name for c in CSV_CONTRACTS["realism"]]
BUDGET_CURVE_COLUMNS = [c.name for c in CSV_CONTRACTS["budget_curve"]]
COST_COLUMNS = [c.name for c in CSV_CONTRACTS["predictor_cost"]]
RUN_COLUMNS = [
    "platform", "model", "experiment", "policy", "storage", "m_max", "compute_opt", "repeat", "tokens_per_s",
    "ready_recall", "n_tokens", "hits", "misses", "prefetched", "wasted", "stall_ms", "source",
    "inflight", "cancelled", "demand_loads", "io_errors", "peak_cache_experts", "capacity_experts",
    "peak_cache_bytes", "capacity_bytes", "decode_s", "record_bytes", "expert_format", "tokens_match",
    "tokens_sha256", "bound_tokens_per_s", "measured_in", "run_order", "layer_m_max", "bound_own_tokens_per_s",
    "block", "emulation", "io_order", "tokens_match_trained", "routing_diff_trained", "routing_sets", "lookahead",
    "budget_rule", "m_max_mean", "batch", "budget_scope",
]
RUN_KEY_COLUMNS = 17  # the first 17 (up to ``source``) every runs CSV must have, measured, simulated or merged

_TRUE = {"true", "1", "yes", "t", "y"}
_FALSE = {"false", "0", "no", "f", "n"}


def _bad(path: Path, column: str, index: int, value: Any, why: str) -> ContractError:
    # index is the 0-based data row; the header is line 1 of the file.
    return ContractError(f"{path}: column {column!r}, line {index + 2}: value {value!r} {why}")


def _coerce(df: pd.DataFrame, col: Column, path: Path) -> pd.Series:
    import numpy as np
    import pandas as pd

    raw = df[col.name]
    missing = raw.isna() | (raw.astype(str).str.strip() == "")
    if missing.any() and not col.nullable:
        i = int(np.flatnonzero(missing.to_numpy())[0])
        raise _bad(path, col.name, i, "", "is empty (the column must be filled on every line)")
    if col.kind == "str":
        out = raw.astype(str).str.strip().where(~missing, "")  # an empty cell of a nullable column: ""
        if col.allowed is not None:
            bad = ~out.isin(col.allowed) & ~missing
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise _bad(path, col.name, i, out.iloc[i], f"is not one of {', '.join(col.allowed)}")
        if col.pattern is not None:
            bad = ~out.str.fullmatch(col.pattern) & ~missing
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise _bad(path, col.name, i, out.iloc[i], f"does not match {col.pattern}")
        return out
    if col.kind == "bool":
        text = raw.astype(str).str.strip().str.lower()
        ok = text.isin(_TRUE | _FALSE)
        if not ok.all():
            i = int(np.flatnonzero((~ok).to_numpy())[0])
            raise _bad(path, col.name, i, raw.iloc[i], "is not a boolean (true/false)")
        return text.isin(_TRUE)
    num = pd.to_numeric(raw.where(~missing), errors="coerce")
    bad = num.isna() & ~missing
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise _bad(path, col.name, i, raw.iloc[i], "is not a number")
    if col.kind == "int":
        frac = (num.dropna() % 1 != 0)
        if frac.any():
            i = df.index.get_loc(frac[frac].index[0])
            raise _bad(path, col.name, i, raw.iloc[i], "is not an integer")
        num = num.astype("Int64") if col.nullable else num.astype(np.int64)
    else:
        num = num.astype(float)
        inf = np.isinf(num.to_numpy(dtype=float, na_value=0.0))
        if inf.any():
            i = int(np.flatnonzero(inf)[0])
            raise _bad(path, col.name, i, raw.iloc[i], "is not finite")
    values = num.astype(float)
    if col.lo is not None:
        low = (values <= col.lo) if col.lo_open else (values < col.lo)
        if low.fillna(False).any():
            i = int(np.flatnonzero(low.fillna(False).to_numpy())[0])
            rel = ">" if col.lo_open else ">="
            raise _bad(path, col.name, i, raw.iloc[i], f"is out of range (must be {rel} {col.lo:g})")
    if col.hi is not None:
        high = (values > col.hi).fillna(False)
        if high.any():
            i = int(np.flatnonzero(high.to_numpy())[0])
            raise _bad(path, col.name, i, raw.iloc[i], f"is out of range (must be <= {col.hi:g})")
    return num


def check_csv(path: str | os.PathLike, contract: str) -> pd.DataFrame:
    """A result CSV checked against ``CSV_CONTRACTS[contract]``: every contract column present, typed, in range and
    filled (unless nullable), at least one row; extra columns are kept as text. One line naming file, column, line."""
    if contract not in CSV_CONTRACTS:
        raise ValueError(f"unknown CSV contract {contract!r}")
    path = Path(path)
    df = read_csv(path, (), f"{contract} results CSV", dtype=str, keep_default_na=False, na_values=[""])
    df.columns = [str(c).strip() for c in df.columns]
    cols = CSV_CONTRACTS[contract]
    for col in cols:
        if col.default is not None and col.name not in df.columns:
            df[col.name] = col.default
    missing = [c.name for c in cols if c.name not in df.columns]
    if missing:
        raise ContractError(f"{path}: missing column(s) {', '.join(repr(m) for m in missing)} "
                            f"(the {contract} contract needs {', '.join(c.name for c in cols)})")
    if df.empty:
        raise ContractError(f"{path}: has a header but no rows")
    df = df.reset_index(drop=True)
    for col in cols:
        df[col.name] = _coerce(df, col, path)
    return df


# ------------------------------------------------------------------------------------------------ names
def member(root: str | os.PathLike, name: Any, what: str) -> Path:
    """``root / name`` for a plain file name listed in a manifest; anything that could leave ``root`` is refused.

    Accepted: one relative path component or a few (``vision/model.safetensors``), none of them ``..``, no
    absolute path, no backslash, no NUL; and the resolved path must stay inside ``root`` (no symlink escape).
    """
    root = Path(root)
    if not isinstance(name, str) or not name:
        raise ContractError(f"{root}: {what} names file {name!r}; a non-empty file name is required")
    parts = name.split("/")
    if ("\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts)
            or PurePosixPath(name).is_absolute()):
        raise ContractError(f"{root}: {what} names {name!r}; only file names inside {root} are accepted")
    path = root / name
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as exc:  # Python 3.11 raises RuntimeError for a symlink loop
        why = "a symlink loop" if isinstance(exc, RuntimeError) else _os_reason(exc)
        raise ContractError(f"{root}: {what} names {excerpt(name)}, which cannot be resolved ({why})") from None
    if not inside:
        raise ContractError(f"{root}: {what} names {name!r}, which resolves outside {root}")
    return path


# ------------------------------------------------------------------------------------------------ tensors
def load_safetensors(path: str | os.PathLike, what: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = regular_file(path, what)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ContractError(f"{path}: unreadable safetensors file, expected {what} "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


_TENSOR = "__tensor__"


def save_tensor_tree(path: str | os.PathLike, tree: Any, fmt: str) -> None:
    """Write a nested structure of dicts, lists, scalars and tensors as one safetensors file (atomically).

    The structure is JSON in the header's metadata with each tensor replaced by a reference; the tensors are the
    file's entries. The safe counterpart of ``torch.save`` for records that the pipeline reads back.
    """
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = obj.detach().cpu().contiguous()
            return {_TENSOR: key}
        if isinstance(obj, dict):
            if _TENSOR in obj:
                raise ValueError(f"key {_TENSOR!r} is reserved in a tensor tree")
            return {str(k): strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [strip(v) for v in obj]
        return obj

    meta = json.dumps({"format": fmt, "tree": strip(tree)}, default=str, separators=(",", ":"))
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"tree": meta})


def load_tensor_tree(path: str | os.PathLike, fmt: str, what: str) -> Any:
    """Read what ``save_tensor_tree`` wrote; the format string and every tensor reference are checked."""
    from safetensors import SafetensorError, safe_open

    path = regular_file(path, what)
    try:
        with safe_open(str(path), framework="pt") as st:
            raw = (st.metadata() or {}).get("tree")
            tensors = {k: st.get_tensor(k) for k in st.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ContractError(f"{path}: unreadable safetensors file, expected {what} ({exc})") from None
    if raw is None:
        raise ContractError(f"{path}: no record structure in its metadata; not a {what}")
    doc = parse_json(raw, f"{path} (metadata)")
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise ContractError(f"{path}: format {got!r}, expected {fmt!r} ({what})")

    def fill(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_TENSOR}:
                if obj[_TENSOR] not in tensors:
                    raise ContractError(f"{path}: refers to tensor {obj[_TENSOR]!r}, which it does not hold")
                return tensors[obj[_TENSOR]]
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fill(v) for v in obj]
        return obj

    return fill(doc["tree"])


# ================================================================================================ hostile values
# Value contracts (issue 30): a file that parses and has the right keys can still hold NaN, a negative count, an id
# that indexes nothing or a name with a newline in it; and a path can be a FIFO, a device or a symlink loop. The
# checks below run before any value is used or any file is opened; each failure is one line naming file and field.

PATH_MAX_BYTES = 4096        # Linux PATH_MAX: a longer path is refused before the OS is asked about it
NAME_MAX_BYTES = 255         # one path component
EXCERPT_CHARS = 80           # an error echoes at most this much of a value
YAML_MAX_NODES = 200_000     # a config's expanded size (scalars, sequences, mappings): aliases cannot inflate it
MAX_IMAGE_PIXELS = 64 << 20  # a workload image's pixel budget (64 Mpx), checked from its header before decoding


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with the total length), so an error line stays short."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def path_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a regular file (too long, NUL, missing, loop, directory, FIFO, device), else
    None. Only ``stat`` is called: nothing is opened, so a FIFO cannot block."""
    import errno
    import stat

    raw = os.fsencode(path)
    if len(raw) > PATH_MAX_BYTES or any(len(part) > NAME_MAX_BYTES for part in raw.split(b"/")):
        return f"path too long ({len(raw)} bytes)"
    if b"\x00" in raw:
        return "path contains a NUL byte"
    try:
        st = os.stat(raw)
    except (FileNotFoundError, NotADirectoryError):
        return "not found"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno == errno.ENAMETOOLONG:
            return "path too long"
        return f"cannot be read ({_os_reason(exc)})"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        return f"is {kind}, not a regular file"
    return None


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` if it is a regular file that ends, else one line (messages as read_bytes always gave them)."""
    why = path_problem(path)
    if why is None:
        return Path(path)
    shown = str(path) if len(os.fsencode(path)) <= PATH_MAX_BYTES else excerpt(str(path))
    if why == "not found":
        raise ContractError(f"{shown}: {what} not found")
    if why == "is a directory":
        raise ContractError(f"{shown}: is a directory, expected {what}")
    raise ContractError(f"{shown}: {why}, expected {what}")


def yaml_expanded_size(node: yaml.Node, where: str, limit: int = YAML_MAX_NODES) -> int:
    """Nodes a composed YAML document expands to (an alias counts its whole target each time it is used), without
    expanding it: a 1 KB alias bomb (9^9) is refused here instead of exhausting memory later."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ContractError(f"{where}:{n.start_mark.line + 1}: recursive YAML alias")
        active.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            total += sum(size(c) for c in n.value)
        elif isinstance(n, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in n.value)
        active.discard(key)
        if total > limit:
            raise ContractError(f"{where}:{n.start_mark.line + 1}: YAML expands to more than {limit} nodes "
                                "(aliases of aliases); a config is small")
        sizes[key] = total
        return total

    try:
        return size(node)
    except RecursionError:
        raise ContractError(f"{where}: YAML nested too deeply") from None


def finite(value: Any, where: str, key: str, lo: float | None = None, hi: float | None = None,
           integer: bool = False, positive: bool = False) -> float:
    """A real number (an int if ``integer``), finite, in [lo, hi] (> 0 if ``positive``); else one line."""
    import math
    import numbers

    ok_type = (isinstance(value, numbers.Integral) if integer else isinstance(value, numbers.Real))
    if isinstance(value, bool) or not ok_type:
        raise ContractError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, "
                            f"got {type(value).__name__} {excerpt(value)}")
    if not math.isfinite(value):
        raise ContractError(f"{where}: {key} is {value}, must be finite")
    if positive and value <= 0:
        raise ContractError(f"{where}: {key}={value} must be > 0")
    if lo is not None and value < lo:
        raise ContractError(f"{where}: {key}={value} must be >= {lo}")
    if hi is not None and value > hi:
        raise ContractError(f"{where}: {key}={value} must be <= {hi}")
    return value


def check_numbers(obj: Any, where: str, key: str = "", lo: float | None = None, nan_ok: bool = False,
                  numbers_only: bool = False) -> None:
    """Every number anywhere in ``obj`` (nested dicts and lists) >= ``lo`` and finite (NaN allowed, as "not
    measured", when ``nan_ok``; never ±Inf); with ``numbers_only`` every leaf must be a number."""
    import math

    if isinstance(obj, dict):
        for k, v in obj.items():
            check_numbers(v, where, f"{key}.{k}" if key else str(k), lo, nan_ok, numbers_only)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_numbers(v, where, f"{key}[{i}]", lo, nan_ok, numbers_only)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if not (nan_ok and math.isnan(obj)):
            finite(obj, where, key, lo=lo)
    elif numbers_only:
        finite(obj, where, key)  # raises: names the key and what it holds


def check_label(value: Any, where: str, key: str, max_len: int = 200) -> str:
    """A name that reaches a CSV cell or LaTeX: text without control characters (a newline would split a row or a
    table line), at most ``max_len`` characters."""
    if not isinstance(value, str):
        raise ContractError(f"{where}: {key} must be text, got {type(value).__name__} {excerpt(value)}")
    bad = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029"), None)
    if bad is not None:
        raise ContractError(f"{where}: {key} {excerpt(value)} holds control character {bad!r}")
    if len(value) > max_len:
        raise ContractError(f"{where}: {key} {excerpt(value)} is longer than {max_len} characters")
    return value


WINDOW_SHAPE_KEYS = ("n_layers", "n_experts", "top_k", "payload_bytes", "io_workers")


def check_window_profile(profile: Mapping[str, Any], where: str, required: Sequence[str] = ()) -> None:
    """profile.json of profile-window: its shape keys (``WINDOW_SHAPE_KEYS``, those in ``required`` must be there)
    are positive integers, and every number in it (durations, sizes, bandwidths, counts) is finite and >= 0."""
    for key in WINDOW_SHAPE_KEYS:
        if key in profile:
            finite(profile[key], where, key, integer=True, positive=True)
    missing = [k for k in required if k not in profile]
    if missing:
        raise ContractError(f"{where}: window profile lacks required key {missing[0]!r}")
    if isinstance(profile.get("top_k"), int) and isinstance(profile.get("n_experts"), int) \
            and profile["top_k"] > profile["n_experts"]:
        raise ContractError(f"{where}: top_k={profile['top_k']} > n_experts={profile['n_experts']}")
    for key, value in profile.items():
        if key == "provenance":
            continue
        if key == "emulation_overshoot_ms":  # measured minus modelled time: either sign
            check_numbers(value, where, key, nan_ok=True)
        elif key == "transfer_ms" and isinstance(value, dict):
            for storage, entry in value.items():  # an emulated storage's overshoot over its intended time may be
                if not isinstance(entry, dict):  # negative (the delay emulation's physical reads vary around their
                    check_numbers(entry, where, f"{key}.{storage}", lo=0)  # median), every time is >= 0
                    continue
                for sub, v in entry.items():
                    overshoot = sub.startswith("overshoot_")
                    check_numbers(v, where, f"{key}.{storage}.{sub}", lo=None if overshoot else 0, nan_ok=overshoot)
        else:  # what the simulator reads must be measured (no NaN); a statistic may be NaN when nothing was timed
            check_numbers(value, where, key, lo=0, nan_ok=key not in _WINDOW_SIM_INPUTS,
                          numbers_only=key in _WINDOW_SIM_INPUTS and key != "transfer_ms")
    transfer = profile.get("transfer_ms")
    for storage, entry in (transfer.items() if isinstance(transfer, dict) else ()):  # the number the simulator reads
        if isinstance(entry, dict) and "transfer_ms" in entry:
            finite(entry["transfer_ms"], where, f"transfer_ms.{storage}.transfer_ms", lo=0)


_WINDOW_SIM_INPUTS = ("n_layers", "n_experts", "top_k", "payload_bytes", "io_workers", "compute", "transfer_ms",
                      "transfer_cpu_ms", "physical_model", "io_interference", "compute_lockstep")


_ROUTING_METRICS = ("tokens_per_s", "ready_recall", "hits", "misses", "prefetched", "wasted", "stall_ms")


def check_routing_values(record: Mapping[str, Any], where: str, n_layers: int, n_experts: int,
                         top_k: int) -> None:
    """A routing record's values (its structure checked by simrun.check_routing_record): integer expert ids in
    [0, n_experts), K = top_k ids per token, layers in [0, n_layers), steps >= 0, metrics finite and >= 0
    (ready_recall a fraction, tokens_per_s > 0)."""
    import torch

    for key, run in record["runs"].items():
        at = f"{where} run {excerpt(key)}"
        for row_name, row in [("row", run["row"]), *((f"repeat {i}", r) for i, r in
                                                     enumerate(run.get("repeats") or []))]:
            for col in _ROUTING_METRICS:
                if col in row:
                    finite(row[col], f"{at} {row_name}", col, lo=0, hi=1 if col == "ready_recall" else None,
                           positive=col == "tokens_per_s")
            for col in ("m_max", "capacity_experts"):
                if col in row:
                    finite(row[col], f"{at} {row_name}", col, lo=0)
        for i, ev in enumerate(run["events"]):
            e = f"{at} event {i}"
            finite(ev["step"], e, "step", lo=0, integer=True)
            finite(ev["layer"], e, "layer", lo=0, hi=n_layers - 1, integer=True)
            t = ev["topk"]
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ContractError(f"{e}: 'topk' has dtype {str(t.dtype).removeprefix('torch.')}, expected "
                                    "integer expert ids")
            if t.shape[1] != top_k:
                raise ContractError(f"{e}: 'topk' is {tuple(t.shape)}, expected {top_k} expert ids per token "
                                    f"(top_k of the window profile)")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_experts):
                bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
                raise ContractError(f"{e}: 'topk' holds expert id {bad}, outside [0, {n_experts})")
            s = ev.get("scores")
            if s is not None and s.is_floating_point() and not bool(torch.isfinite(s).all()):
                raise ContractError(f"{e}: 'scores' holds NaN or Inf")


def check_finite_tensors(tensors: Mapping[str, Any], where: str) -> None:
    """Floating-point tensors (predictor weights, trace inputs and logits) hold no NaN or Inf."""
    import torch

    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ContractError(f"{where}: tensor {excerpt(name)} holds NaN or Inf")


def check_model_dims(dims: Mapping[str, Any], where: str) -> None:
    """A predictor's (or trace's) shape numbers: positive integers, top_k <= n_experts."""
    for key in ("n_layers", "hidden_size", "n_experts", "top_k"):
        if key in dims:
            finite(dims[key], where, f"dims.{key}", integer=True, positive=True)
    if isinstance(dims.get("top_k"), int) and isinstance(dims.get("n_experts"), int) \
            and dims["top_k"] > dims["n_experts"]:
        raise ContractError(f"{where}: dims.top_k={dims['top_k']} > dims.n_experts={dims['n_experts']}")


def check_pixel_budget(size: tuple[int, int], where: str, budget: int = MAX_IMAGE_PIXELS) -> None:
    """An image's declared width x height (from its header; PIL decodes lazily) within ``budget`` pixels, checked
    before any pixel is decoded: a 1 KB PNG can declare 10^10 pixels."""
    w, h = size
    if w <= 0 or h <= 0 or w * h > budget:
        raise ContractError(f"{where}: image of {w} x {h} pixels exceeds the budget of {budget} pixels")
