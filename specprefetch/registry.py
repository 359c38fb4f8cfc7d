"""One registry per vocabulary: predictor methods, runtime policies, storages, workload generators, platforms.

Each name is written once, here, with everything the project needs to know about it (label, colour, whether it is
trained, which runtime policy it drives, where its class lives). The old constants (``METHODS``, ``METHOD_LABELS``,
``LEARNED_METHODS``, ``POLICY``, ``STORAGES``, the palette, the storage labels ...) are live views of these tables,
and the config schema's enums are filled from them when a config is validated (``config._schema``); a test ties the
schema file's literal enums to the tables.

Predictor methods can also come from other installed packages: an entry point of the group
``specprefetch.predictors`` (``myname = mypkg.module:MyPredictor``) names a ``Predictor`` subclass, or a
:class:`Method` object, carrying the metadata as class attributes (``label``, ``color``, ``learned``,
``runtime_policy``). Its name then works everywhere a built-in's does: the schema, training, evaluation, the
runtime (a policy of the same name when ``runtime_policy``), the tables and the figures. A plugin that fails to
import, lacks its metadata or reuses a name is one ``RegistryError`` line naming its entry point.

This module sits in the lowest layer: it imports nothing of the package but ``io``, and a built-in method's class
is named by a module path (imported by ``predictors.base.predictor_class``), so reading the vocabulary needs no torch.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, TypeVar, overload

from specprefetch.io import SpecPrefetchError

ENTRY_POINT_GROUP = "specprefetch.predictors"
T = TypeVar("T")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")  # a method name is a wildcard value and a directory name


class RegistryError(SpecPrefetchError):
    """A name no registry knows, or a plugin that cannot be registered; the message names it."""


class UnknownName(RegistryError, KeyError):
    """``VIEW[name]`` of a name the registry lacks: one line (and still a KeyError, so ``.get`` and ``in`` work)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# ------------------------------------------------------------------------------------------------ entries
@dataclass(frozen=True)
class Method:
    """A next-layer expert predictor: its display label and colour (every table and figure), whether it is trained
    (the DAG's training jobs, Table 3), whether the runtime prefetches with it, and where its class lives."""

    name: str
    label: str
    color: str
    learned: bool
    target: str                  # "package.module" (registers the class on import) or "package.module:Class"
    runtime_policy: bool = False  # a runtime prefetch policy of the same name, this predictor its priority provider
    sees_future: bool = False     # it reads the routing it predicts (the oracle): an upper bound, never run live
    source: str = "built-in"      # or the entry point it came from
    extension: bool = False       # beyond the paper, yet a row of Tables 1 and 3 (marked so) when configured


@dataclass(frozen=True)
class Policy:
    """What a runtime policy does: the one table the runtime, the simulator, the benchmarks and lm-eval read."""

    name: str
    predicts: bool                 # priorities for the next layer are computed (and the selection at M_max)
    issues: bool                   # the selected experts are prefetched
    provider: str | None = None    # the priority provider it needs (a --predictor key; None: none or built in)
    preload: bool = False          # every expert resident before the run
    method: str | None = None      # the predictor method it runs (label and colour are that method's)
    label: str | None = None       # its own label and colour, when it runs no method of its own
    color: str | None = None
    latex: str | None = None       # LaTeX form when the paper typesets it differently

    @property
    def budgeted(self) -> bool:
        """Its runs have a budget M_max (PRED0 selects at M_max but issues nothing)."""
        return self.predicts


@dataclass(frozen=True)
class Storage:
    """Where experts are read from: kind ``physical`` (the real disk, cold), ``ram``, or ``emulated`` (the real
    read paced to a device model whose default numbers are here, overridable by ``device.storage_profiles``)."""

    name: str
    label: str
    speed_rank: int                # Figure 5's x axis, fastest first
    kind: str = "emulated"
    bandwidth_mbps: float | None = None
    latency_ms: float | None = None

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"


# ------------------------------------------------------------------------------------------------ the built-ins
# In the paper's order (tables and figures list methods in this order).
BUILTIN_METHODS: tuple[Method, ...] = (
    Method("fate", "FATE", "#0072B2", learned=False, target="specprefetch.predictors.fate", runtime_policy=True),
    Method("draft_model", "Draft Model", "#E69F00", learned=True, target="specprefetch.predictors.draft_model"),
    Method("promoe", "ProMoE", "#009E73", learned=True, target="specprefetch.predictors.promoe"),
    Method("single_mlp", "Single MLP", "#56B4E9", learned=True, target="specprefetch.predictors.single_mlp"),
    Method("specprefetch", "SpecPrefetch", "#D55E00", learned=True, target="specprefetch.predictors.specprefetch",
           runtime_policy=True),
    Method("previous_token", "Naive Prefetch", "#CC79A7", learned=False,
           target="specprefetch.predictors.previous_token"),
    Method("frequency", "Frequency", "#8C6D31", learned=False, target="specprefetch.predictors.frequency"),
    Method("oracle", "Oracle", "#000000", learned=False, target="specprefetch.predictors.oracle", sees_future=True),
    # beyond the paper: layer l's experts from layer l's own pre-attention input (arXiv 2511.10676)
    Method("pre_attention", "Pre-Attention", "#7B3294", learned=True, target="specprefetch.predictors.pre_attention",
           runtime_policy=True, extension=True),
)

BUILTIN_POLICIES: tuple[Policy, ...] = (
    Policy("off", predicts=False, issues=False, label="OFF", color="#7F7F7F"),
    Policy("pred0", predicts=True, issues=False, provider="specprefetch", label="PRED0", color="#BDBDBD",
           latex=r"PRED$_0$"),
    Policy("specprefetch", predicts=True, issues=True, provider="specprefetch", method="specprefetch"),
    Policy("naive", predicts=True, issues=True, method="previous_token"),  # the previous token's experts: built in
    Policy("fate", predicts=True, issues=True, provider="fate", method="fate"),
    Policy("resident", predicts=False, issues=False, preload=True, label="All resident", color="#3B3B3B"),
    # beyond the paper: prefetches for layer l issued before layer l's attention, from its pre-attention input
    Policy("pre_attention", predicts=True, issues=True, provider="pre_attention", method="pre_attention"),
)
# Figures and tables list policies in this order (plugin policies go before the all-resident bound).
POLICY_DISPLAY_ORDER = ("off", "pred0", "naive", "fate", "specprefetch", "pre_attention", "resident")

BUILTIN_STORAGES: tuple[Storage, ...] = (
    Storage("nvme_cold", "NVMe (cold)", 2, kind="physical"),
    Storage("nvme", "NVMe", 1, bandwidth_mbps=4200.0, latency_ms=0.08),
    Storage("ufs", "UFS", 3, bandwidth_mbps=2100.0, latency_ms=0.12),
    Storage("slow_ufs", "Slow UFS", 4, bandwidth_mbps=850.0, latency_ms=0.20),
    Storage("sdcard", "SD card", 5, bandwidth_mbps=90.0, latency_ms=1.00),
    Storage("ram", "RAM", 0, kind="ram"),
)

# Workload generators (workloads.<w>.generator) and the training corpus' offline sources (train_corpus.mixture).
WORKLOAD_GENERATORS = ("gsm8k_synth", "humaneval", "ocr_synth", "chartqa_synth", "hallusion_synth", "hub", "local")
CORPUS_SOURCES = ("gsm8k_synth", "ocr_synth", "chartqa_synth", "hallusion_synth", "stdlib_code", "stdlib_docs")
# Budget rules beyond the paper (device.extra_rules, runs.csv's budget_rule): the DP allotment, the online EWMA rule and
# the simulated rule (runtime.core.budget decides them; render.figures.BUDGET_RULES draws them with the paper's two).
EXTRA_BUDGET_RULES = ("dp", "ewma", "simulated")
# Simulated platforms (device.simulator.platforms); their numbers are runtime.simulation.platforms.PLATFORMS.
PLATFORMS = ("snapdragon_8_elite",)


# ------------------------------------------------------------------------------------------------ plugins
_generation = 0
_cache: dict[str, Any] = {}


def refresh() -> None:
    """Forget the discovered plugins and every derived table (after installing a plugin in-process, or after a
    test changed a ``BUILTIN_*`` table)."""
    global _generation
    _generation += 1
    _cache.clear()


def _cached(key: str, build: Callable[[], Any]) -> Any:
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


def _where(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return f"entry point '{ep.name} = {ep.value}' (group {ENTRY_POINT_GROUP}{f', package {name}' if name else ''})"


def _plugin_method(ep: metadata.EntryPoint) -> Method:
    """The Method an entry point declares: a Method object, or a Predictor subclass with class attributes
    ``label``, ``color`` (and ``learned``, ``runtime_policy``)."""
    where = _where(ep)
    try:
        obj = ep.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of foreign code is one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RegistryError(f"{where}: cannot be loaded ({type(exc).__name__}: {first})") from None
    if isinstance(obj, Method):
        if obj.name != ep.name:
            raise RegistryError(f"{where}: its Method is named {obj.name!r}, not {ep.name!r}")
        return replace(obj, source=where)
    if not isinstance(obj, type):
        raise RegistryError(f"{where}: names a {type(obj).__name__}, not a Predictor subclass or a Method")
    declared = getattr(obj, "method", "") or ep.name
    if declared != ep.name:
        raise RegistryError(f"{where}: the class says method {declared!r}, the entry point {ep.name!r}")
    meta = {k: getattr(obj, k, None) for k in ("label", "color")}
    missing = [k for k, v in meta.items() if not isinstance(v, str) or not v]
    if missing:
        raise RegistryError(f"{where}: the class lacks {' and '.join(missing)} (class attributes naming the "
                            "method's display label and colour in tables and figures)")
    if not re.fullmatch(r"#[0-9A-Fa-f]{6}", meta["color"]):
        raise RegistryError(f"{where}: color {meta['color']!r} is not a #RRGGBB colour")
    return Method(ep.name, meta["label"], meta["color"], learned=bool(getattr(obj, "learned", True)),
                  target=ep.value, runtime_policy=bool(getattr(obj, "runtime_policy", False)), source=where)


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _plugin_names() -> tuple[str, ...]:
    """Names of the installed plugin methods, checked (valid, unique, no built-in name) without importing them."""

    def build() -> tuple[str, ...]:
        builtin = {m.name for m in BUILTIN_METHODS} | {p.name for p in BUILTIN_POLICIES}
        seen: dict[str, str] = {}
        for ep in _entry_points():
            where = _where(ep)
            if not NAME_PATTERN.match(ep.name):
                raise RegistryError(f"{where}: {ep.name!r} is not a method name (lower-case letters, digits, _)")
            if ep.name in builtin:
                raise RegistryError(f"{where}: {ep.name!r} is already a built-in method or policy name")
            if ep.name in seen:
                raise RegistryError(f"{where}: method {ep.name!r} is registered twice (also by {seen[ep.name]})")
            seen[ep.name] = where
        return tuple(seen)

    return _cached("plugin_names", build)


def _plugins() -> tuple[Method, ...]:
    def build() -> tuple[Method, ...]:
        names = set(_plugin_names())
        return tuple(_plugin_method(ep) for ep in _entry_points() if ep.name in names)

    return _cached("plugins", build)


# ------------------------------------------------------------------------------------------------ lookups
def methods() -> dict[str, Method]:
    """Every method, built-ins (the paper's order) then plugins (by name); importing each plugin once."""
    return _cached("methods", lambda: {m.name: m for m in (*BUILTIN_METHODS, *_plugins())})


def method_names() -> tuple[str, ...]:
    """The method names without importing any plugin (the schema's enum at config load)."""
    return _cached("method_names", lambda: (*(m.name for m in BUILTIN_METHODS), *_plugin_names()))


def _lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[name]``, or one line naming the unknown name and the known ones."""
    if name not in table:
        raise UnknownName(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[name]


def method(name: str) -> Method:
    return _lookup(methods(), name, "predictor method")


def is_plugin(name: str) -> bool:
    return name in _plugin_names()


def policies() -> dict[str, Policy]:
    """Every runtime policy: the built-ins, then one per plugin method that declares ``runtime_policy``."""

    def build() -> dict[str, Policy]:
        out = {p.name: p for p in BUILTIN_POLICIES}
        for m in _plugins():
            if m.runtime_policy:
                out[m.name] = Policy(m.name, predicts=True, issues=True, provider=m.name, method=m.name)
        return out

    return _cached("policies", build)


def policy(name: str) -> Policy:
    return _lookup(policies(), name, "runtime policy")


def policy_label(name: str) -> str:
    p = policy(name)
    return p.label if p.label is not None else method(p.method or "").label


def policy_color(name: str) -> str:
    p = policy(name)
    return p.color if p.color is not None else method(p.method or "").color


def policy_order() -> tuple[str, ...]:
    """Display order: the built-ins' (``POLICY_DISPLAY_ORDER``) with plugin policies before the all-resident bound."""

    def build() -> tuple[str, ...]:
        extra = [p for p in policies() if p not in POLICY_DISPLAY_ORDER]
        *head, last = POLICY_DISPLAY_ORDER
        return (*head, *extra, last)

    return _cached("policy_order", build)


def runtime_providers() -> tuple[str, ...]:
    """The predictor methods a runtime policy needs as its priority provider (``--predictor`` keys), in policy
    order: the learned or gate-built predictors the device stage loads."""
    return _cached("providers", lambda: tuple(dict.fromkeys(p.provider for p in policies().values() if p.provider)))


def storages() -> dict[str, Storage]:
    return _cached("storages", lambda: {s.name: s for s in BUILTIN_STORAGES})


def storage(name: str) -> Storage:
    return _lookup(storages(), name, "storage")


def storage_order() -> tuple[str, ...]:
    """Fastest to slowest: Figure 5's x axis."""
    return _cached("storage_order", lambda: tuple(sorted(storages(), key=lambda s: storages()[s].speed_rank)))


# ------------------------------------------------------------------------------------------------ live views


class NameView(Sequence[str]):
    """A tuple of names computed from the registry on use (so a plugin or a test's storage is seen everywhere)."""

    def __init__(self, build: Callable[[], Sequence[str]], what: str) -> None:
        self._build = build
        self._what = what

    def _names(self) -> tuple[str, ...]:
        return tuple(self._build())

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and self._names() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class TableView(Mapping[str, T]):
    """A name -> value mapping computed from the registry on use; an unknown name is one ``UnknownName`` line."""

    def __init__(self, build: Callable[[], Mapping[str, T]], what: str) -> None:
        self._build = build
        self._what = what

    def __getitem__(self, name: str) -> T:
        return _lookup(self._build(), name, self._what)

    def __len__(self) -> int:
        return len(self._build())

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __contains__(self, name: object) -> bool:
        return name in self._build()

    def __repr__(self) -> str:
        return repr(dict(self._build()))


def import_target(m: Method) -> Any:
    """Import what ``m.target`` names: the module (a built-in registers its class on import) or ``module:attr``."""
    mod, _, attr = m.target.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - foreign code: one line naming where it came from
        raise RegistryError(f"method {m.name!r} ({m.source}): cannot import {m.target} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    return obj
