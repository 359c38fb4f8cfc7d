"""The prefetch budget M_max (paper §3.3), decided here and nowhere else.

M_max bounds how many experts of layer ``l+1`` layer ``l`` may prefetch. Every caller (window profiling, the
benchmarks, the harness, the runtime and the simulator, the simulated platforms, the lm-eval wrapper, the CLI and
the scripts) asks this module:

- **configured or auto**: a budget setting (``device.m_max``, ``device.simulator.m_max``) is an integer -- that
  budget on every storage and every layer -- or ``auto``: the window rule below, per storage, read from the window
  profile (:func:`storage_budgets`, :func:`layer_budgets`);
- **the window rule** (:func:`derive_m_max`): ``M_max = max(1, floor(W / t_transfer))``, at most ``n_experts``: as many
  experts as the storage delivers within the prefetch window ``W``. Per storage from the median window and that
  storage's per-expert transfer time; per layer ``l`` (the layer prefetched into) from layer ``l-1``'s median window
  (:func:`window_budgets`, which ``profile_window`` writes as ``m_max_per_storage`` / ``m_max_per_layer``);
- **whose profile** (``device.budget_scope``): ``platform`` (default, the paper's) reads the reference storage's on
  every storage, as the paper profiles one M_max on its target platform (§3.3) and keeps it on the emulated slow
  storage (Table 5); ``storage`` (beyond the paper) reads each storage's own budget (:func:`budget_source`);
- **which rule** (``device.budget_rule``): ``window`` (the paper's, above) or ``simulated``: the budget the
  trace-driven simulator, fed the window profile alone, finds fastest (``m_max_simulated_per_storage``, written by
  :mod:`specprefetch.runtime.simulation.budget_model`, which says why the window rule under-budgets). Both are
  profiled either way; the sweep measures both (:func:`rule_budgets`);
- **which policies have a budget** (:func:`has_budget`): those the ``Policy`` table marks ``budgeted`` (they select at
  M_max; PRED0 selects and issues nothing); every other policy runs with budget 0 and no per-layer budgets
  (:func:`run_budget`);
- **per-layer budgets** are a tuple indexed by the layer prefetched into; index 0 (never prefetched into) holds the
  storage's M_max; budgets equal to M_max in every layer are the one budget (``()``); :func:`layer_budget` is the
  budget of one layer, as the runtime and the simulator apply it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specprefetch.contracts import POLICY, ContractError, check_window_profile, read_doc
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.timeline import busy_s

AUTO = "auto"
# profile.json's ``m_max_rule``: how the window profile's budgets were derived
RULE = "max(1, floor(median W / per-expert service time in the runtime)) per storage"


class BudgetError(SpecPrefetchError):
    """A budget setting or the window profile it needs is unusable; the message names the key or storage."""


def is_auto(setting: Any, key: str = "device.m_max") -> bool:
    """True for ``auto`` (the window rule), False for a configured integer >= 0; anything else is an error."""
    if setting == AUTO:
        return True
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise BudgetError(f"invalid config key {key!r}: {setting!r} (an integer >= 0 or 'auto')")
    return False


def derive_m_max(window_ms: float, transfer_ms: float, n_experts: int) -> int:
    """The window rule: ``max(1, floor(window / transfer))``, at most ``n_experts``; a free transfer (<= 0) or an
    unmeasured window gives ``n_experts`` (every expert fits)."""
    if transfer_ms <= 0 or not math.isfinite(window_ms):
        return n_experts
    return int(min(n_experts, max(1, math.floor(window_ms / transfer_ms))))


def window_budgets(setting: Any, window_ms: float, layer_window_ms: Mapping[int, float],
                   transfer_ms: Mapping[str, float], n_experts: int,
                   key: str = "device.m_max") -> tuple[dict[str, int], dict[str, list[int]]]:
    """(per-storage, per-layer) budgets from measured windows: per storage the rule on the median window
    ``window_ms`` with that storage's transfer time (or the configured integer); per layer the rule on each layer's
    median window ``layer_window_ms[l]`` (l: the layer predicting, in order; always derived, so a profile shows what
    auto would give)."""
    auto = is_auto(setting, key)
    per_storage = {st: derive_m_max(window_ms, t, n_experts) if auto else int(setting) for st, t in transfer_ms.items()}
    per_layer = {st: [derive_m_max(layer_window_ms[layer], t, n_experts) for layer in sorted(layer_window_ms)]
                 for st, t in transfer_ms.items()}
    return per_storage, per_layer


def read_window_profile(window_dir: str | os.PathLike, model: str | None = None) -> dict[str, Any]:
    """``profile-window``'s ``profile.json`` in ``window_dir`` (the budgets' source when auto): one line naming the
    file when it is missing or malformed, or is another model's than ``model``."""
    path = Path(window_dir) / "profile.json"
    try:
        profile = read_doc(path, None, "window profile")
    except ContractError as exc:
        why = str(exc).removeprefix(f"{path}: ")
        raise BudgetError(f"{path}: cannot read the window profile ({why}); run profile-window first") from None
    if model is not None and profile.get("model") != model:
        raise BudgetError(f"{path} is for model {profile.get('model')!r}, not {model!r}")
    check_window_profile(profile, str(path))  # shape keys positive, every number finite and >= 0
    return profile


def budget_storages(settings: Mapping[str, Any]) -> list[str]:
    """The storages that get a budget: the reference, the slow and every benchmarked one (in that order)."""
    return list(dict.fromkeys([settings["reference_storage"], settings["slow_storage"], *settings["storages"]]))


RULE_KEYS = {"window": "m_max_per_storage", "simulated": "m_max_simulated_per_storage"}
SCOPES = ("platform", "storage")


def budget_scope(settings: Mapping[str, Any]) -> str:
    """``device.budget_scope`` (``platform`` when unset: the paper's), checked."""
    scope = settings.get("budget_scope", "platform")
    if scope not in SCOPES:
        raise BudgetError(f"invalid config key 'device.budget_scope': {scope!r} (one of {', '.join(SCOPES)})")
    return str(scope)


def budget_source(settings: Mapping[str, Any], storage: str) -> str:
    """The storage whose profiled budget ``storage`` runs at (``device.budget_scope``): itself, or under ``platform``
    the reference storage (``device.reference_storage``), the one M_max the paper profiles on its target platform."""
    return str(settings["reference_storage"]) if budget_scope(settings) == "platform" else storage


def sourced_budgets(settings: Mapping[str, Any], per: Mapping[str, Any], names: Iterable[str],
                    what: str) -> dict[str, Any]:
    """``per[budget_source(st)]`` for each storage ``st`` of ``names`` (``per``: a value per storage, e.g. the
    profile's budgets); an error naming the storages ``per`` (the profile's ``what``) lacks."""
    src = {st: budget_source(settings, st) for st in names}
    missing = [s for s in dict.fromkeys(src.values()) if s not in per]
    if missing:
        raise BudgetError(f"window profile has no {what} for storage {', '.join(missing)}: rerun profile-window")
    return {st: per[s] for st, s in src.items()}


def _rule_budgets(profile: Mapping[str, Any], rule: str, names: Sequence[str],
                  settings: Mapping[str, Any]) -> dict[str, int]:
    """The window profile's budget of each storage in ``names`` by ``rule`` (``RULE_KEYS``), read from its
    :func:`budget_source`."""
    got = sourced_budgets(settings, profile.get(RULE_KEYS[rule]) or {}, names, f"{rule}-rule M_max")
    return {st: int(m) for st, m in got.items()}


def budget_rule(settings: Mapping[str, Any]) -> str:
    """``device.budget_rule`` (``window`` when unset: the paper's)."""
    rule = settings.get("budget_rule", "window")
    if rule not in RULE_KEYS:
        raise BudgetError(f"invalid config key 'device.budget_rule': {rule!r} (one of {', '.join(RULE_KEYS)})")
    return str(rule)


def storage_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any] | None,
                    storages: Iterable[str] | None = None, need: str = "a window profile") -> dict[str, int]:
    """M_max per storage (default :func:`budget_storages`): ``device.m_max`` when an integer, else the window
    profile's budget of each storage by ``device.budget_rule``. ``need`` says, in the error for an auto budget
    without a profile, how the caller gets one (e.g. "--window (a profile-window directory)")."""
    names = list(budget_storages(settings) if storages is None else storages)
    if not is_auto(settings["m_max"]):
        return {st: int(settings["m_max"]) for st in names}
    if profile is None:
        raise BudgetError(f"device.m_max is auto: its M_max comes from the window profile; give {need}")
    return _rule_budgets(profile, budget_rule(settings), names, settings)


def rule_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any] | None) -> dict[str, set[int]]:
    """Per storage, the budgets every rule the profile has gives (the sweep measures them all, so Figure 4 judges
    each rule against the measured optimum); empty for a configured integer budget or without a profile."""
    if profile is None or not is_auto(settings["m_max"]):
        return {}
    names = budget_storages(settings)
    out: dict[str, set[int]] = {st: set() for st in names}
    for rule, key in RULE_KEYS.items():
        if key in profile:
            for st, m in _rule_budgets(profile, rule, names, settings).items():
                out[st].add(m)
    return out


LAYER_RULE_KEYS = {"window": "m_max_per_layer", "dp": "m_max_dp_per_layer"}


def layer_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any],
                  budgets: Mapping[str, int], rule: str = "window") -> dict[str, tuple[int, ...]]:
    """Per-layer budgets per storage of ``budgets`` (index: the layer prefetched into; layer 0's is the storage's
    M_max) by ``rule`` (``LAYER_RULE_KEYS``: the window rule per layer, ``floor(W_l / t)``, or the DP allotment of
    the same total, :func:`allot_layer_budgets`) from the window profile, when the budget is auto by the window rule;
    none (the one budget) for a configured integer, the simulated rule, or a storage the profile has no per-layer
    budgets for."""
    if not is_auto(settings["m_max"]) or budget_rule(settings) != "window":
        return {}
    key = LAYER_RULE_KEYS[rule]
    per = profile.get(key) or {}
    n_layers = int(profile.get("n_layers", 0))
    out = {}
    for st, m in budgets.items():
        layers = per.get(budget_source(settings, st))
        if layers is None:
            continue
        if len(layers) != n_layers - 1:
            raise BudgetError(f"window profile's {key}[{st!r}] has {len(layers)} layers, expected "
                              f"{n_layers - 1}: rerun profile-window")
        out[st] = (m, *(int(x) for x in layers))
    return out


def allot_layer_budgets(values: Sequence[Mapping[int, float]], total: int) -> tuple[int, ...]:
    """Per-layer budgets by dynamic programming (beyond the paper, after AdapMoE's per-layer allotment): the budgets
    ``M_l`` (one per entry of ``values``, each a key of its mapping) of the largest ``sum_l values[l][M_l]`` with
    ``sum_l M_l <= total``; among equal sums the smaller total, then the earlier layers' smaller budgets. ``values``
    need not be concave (the DP is exact). An error when even the smallest budgets exceed ``total``."""
    if not values:
        return ()
    floor_total = sum(min(v) for v in values)
    if floor_total > total:
        raise BudgetError(f"the per-layer budgets need at least {floor_total} transfers per token, the total is "
                          f"{total}")
    # best[c]: the largest value of the layers so far using c transfers in all; choice[l][c]: layer l's budget there
    best: dict[int, float] = {0: 0.0}
    choice: list[dict[int, int]] = []
    for v in values:
        nxt: dict[int, float] = {}
        pick: dict[int, int] = {}
        for c, acc in best.items():
            for m in sorted(v):
                c2 = c + int(m)
                if c2 > total:
                    break
                val = acc + float(v[m])
                if c2 not in nxt or val > nxt[c2] + 1e-12:
                    nxt[c2], pick[c2] = val, int(m)
        best, choice = nxt, [*choice, pick]
    c = min(best, key=lambda k: (-round(best[k], 9), k))
    out = []
    for pick in reversed(choice):
        m = pick[c]
        out.append(m)
        c -= m
    return tuple(reversed(out))


def lookahead_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any] | None, budgets: Mapping[str, int],
                      distances: Iterable[int]) -> dict[str, dict[int, int]]:
    """M_max per storage and look-ahead distance ``d`` (beyond the paper: layer l prefetches into l+d, so its
    transfers have the windows of layers l..l+d-1): the window rule on the window summed over d layers,
    ``max(1, floor(d * median W / t_transfer))``, when the budget is auto by the window rule; else ``d`` times the
    storage's budget (a configured integer, or the simulated rule's). At most ``n_experts`` either way; ``d = 1`` is
    the storage's own budget. The d sets in flight at once share one storage, so whether the longer window pays
    is what the ``lookahead`` experiment measures."""
    out: dict[str, dict[int, int]] = {}
    ds = sorted({int(d) for d in distances})
    window_rule = profile is not None and is_auto(settings["m_max"]) and budget_rule(settings) == "window"
    n = int(profile["n_experts"]) if profile is not None else None
    for st, m in budgets.items():
        if window_rule:
            assert profile is not None and n is not None
            t = (profile.get("transfer_ms_used") or {}).get(budget_source(settings, st))
            if t is None:
                raise BudgetError(f"window profile has no transfer_ms_used for storage {st}: rerun profile-window")
            w = float(profile["window_ms_median"])
            out[st] = {d: int(m) if d == 1 else derive_m_max(d * w, float(t), n) for d in ds}
        else:
            out[st] = {d: int(m) * d if n is None else min(n, int(m) * d) for d in ds}
    return out


PRE_ATTENTION_KEY = "m_max_pre_attention_per_storage"


def pre_attention_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any] | None,
                          budgets: Mapping[str, int]) -> dict[str, int]:
    """M_max per storage of the pre-attention policy (beyond the paper: its prefetches for layer l go out before
    layer l's attention, so its window is that attention, not a whole layer): the window rule on its own window
    (``window_ms_median_pre_attention``, measured by ``profile_window``) when the budget is auto by the window rule;
    else the storage's budget ``budgets[storage]`` (a configured integer, or the simulated rule's)."""
    if profile is None or not is_auto(settings["m_max"]) or budget_rule(settings) != "window":
        return {st: int(m) for st, m in budgets.items()}
    got = sourced_budgets(settings, profile.get(PRE_ATTENTION_KEY) or {}, budgets, "pre-attention M_max")
    return {st: int(m) for st, m in got.items()}


BATCH_KEY = "m_max_batch_per_storage"  # profile.json: {B: {storage: M_max}} for the batch sizes beyond 1
BATCH_WINDOW_KEY = "window_ms_median_batch"  # profile.json: {B: the median window decoding a batch of B}


def batch_budgets(settings: Mapping[str, Any], profile: Mapping[str, Any] | None,
                  budgets: Mapping[str, int]) -> dict[int, dict[str, int]]:
    """M_max per batch size and storage of the batch experiment (``device.batch``; beyond the paper): for one sequence
    the storage's budget ``budgets[storage]``; for a batch of B the window rule on the window measured decoding that
    batch (``profile_window``: a batch step computes the union of B tokens' experts, so its window is longer), when
    the budget is auto by the window rule; else ``budgets[storage]`` at every size (a configured integer, or the
    simulated rule's: one budget per storage)."""
    bcfg = settings["batch"]
    sizes, storages = [int(b) for b in bcfg["sizes"]], list(bcfg["storages"])
    missing = [st for st in storages if st not in budgets]
    if missing:
        raise BudgetError(f"device.batch.storages: no budget for {', '.join(missing)}")
    one = {st: int(budgets[st]) for st in storages}
    if profile is None or not is_auto(settings["m_max"]) or budget_rule(settings) != "window":
        return {b: dict(one) for b in sizes}
    per = profile.get(BATCH_KEY) or {}
    out = {}
    for b in sizes:
        if b == 1:
            out[b] = dict(one)
            continue
        got = sourced_budgets(settings, per.get(str(b)) or {}, storages, f"M_max for a batch of {b}")
        out[b] = {st: int(m) for st, m in got.items()}
    return out


# the EWMA's gain: RFC 6298's for the smoothed round-trip time (a standard estimator's, not fitted here)
EWMA_ALPHA = 0.125


@dataclass
class EwmaBudget:
    """The online window rule (beyond the paper; ``device.budget_rules: [ewma]``): the budget of each prediction step
    from what the run itself measured so far, ``max(1, floor(d * W_ewma / t_ewma) - q)``, at most ``n_experts``:

    - ``W_ewma``: an exponentially weighted moving average (gain ``alpha``) of the prefetch windows the run's own
      decoding layers gave (:func:`~specprefetch.runtime.core.timeline.window_ms`), seeded with the window profile's
      median window;
    - ``t_ewma``: the same average of each finished decoding step's per-expert service time (the time its storage
      was serving some transfer over the number it served, as ``profile_window`` measures it), seeded with the
      profile's service time of the storage;
    - ``q``: the transfers queued or running at the prediction step that the new prefetches wait behind, but the
      predicting layer's own demand loads (the measured window already leaves out the time the layer stalls for
      them; counting them again would take the window twice);
    - ``d``: the look-ahead (the window summed over d layers).

    The paper's rule is the same quotient from the profile alone, fixed for the whole run. MoE-Infinity sizes its
    prefetching online from the window and the queue in the same spirit; its released code enqueues every predicted
    expert in a priority queue, so this rule is ours, named after the idea, not a port. One object per run
    (:meth:`fresh`): the runtime and the simulator feed it the same observations from the shared per-layer loop."""

    window_ms: float
    transfer_ms: float
    n_experts: int
    alpha: float = EWMA_ALPHA
    _seen: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_ms) and self.window_ms > 0 and math.isfinite(self.transfer_ms)
                and self.transfer_ms > 0):
            raise BudgetError(f"the EWMA budget needs a positive measured window and transfer time, got "
                              f"{self.window_ms!r} ms and {self.transfer_ms!r} ms: rerun profile-window")
        if not 0 < self.alpha <= 1:
            raise BudgetError(f"the EWMA gain must lie in (0, 1], got {self.alpha!r}")

    def fresh(self) -> EwmaBudget:
        """The same rule with its seeds, for a new run."""
        return EwmaBudget(self.window_ms, self.transfer_ms, self.n_experts, self.alpha)

    def _fold(self, attr: str, value: float) -> None:
        if math.isfinite(value) and value > 0:
            old = getattr(self, attr)
            setattr(self, attr, old + self.alpha * (value - old))

    def observe_window(self, ms: float) -> None:
        """A decoding layer's prefetch window, in ms."""
        self._fold("window_ms", ms)

    def observe_transfers(self, log: Sequence[Any], step: int) -> None:
        """Fold in the service time of every decoding step before ``step`` whose transfers ``log`` (the I/O backend's
        transfers in submission order) newly holds: per step, the time some charged transfer was running over the
        number that ran."""
        by_step: dict[int, list[Any]] = {}
        i = self._seen
        while i < len(log) and log[i].step < step:
            tr = log[i]
            if tr.state == "done" and tr.charged and tr.t_end > tr.t_start > 0:
                by_step.setdefault(tr.step, []).append(tr)
            i += 1
        self._seen = i
        for trs in by_step.values():
            self._fold("transfer_ms", busy_s(trs) / len(trs) * 1e3)

    def budget(self, queued: int, lookahead: int = 1) -> int:
        """M_max now, with ``queued`` transfers queued or running."""
        fit = math.floor(lookahead * self.window_ms / self.transfer_ms) - int(queued)
        return int(min(self.n_experts, max(1, fit)))


def ewma_budgets(profile: Mapping[str, Any] | None, n_experts: int) -> dict[str, EwmaBudget]:
    """The online EWMA rule per storage, seeded with the window profile's median window and that storage's service
    time (``transfer_ms_used``); empty without a profile."""
    if profile is None:
        return {}
    if "window_ms_median" not in profile:
        raise BudgetError("the window profile has no window_ms_median, which seeds the EWMA budget: rerun "
                          "profile-window")
    w = float(profile["window_ms_median"])
    return {st: EwmaBudget(w, float(t), int(n_experts)) for st, t in (profile.get("transfer_ms_used") or {}).items()}


def online_budget(policy: str, ewma: EwmaBudget | None) -> EwmaBudget | None:
    """A fresh online rule for one run of ``policy`` (None without one, or for a policy without a budget)."""
    return ewma.fresh() if ewma is not None and has_budget(policy) else None


def has_budget(policy: str) -> bool:
    """Whether runs of ``policy`` have a budget (the ``Policy`` table's ``budgeted``: they select at M_max)."""
    if policy not in POLICY:
        raise BudgetError(f"unknown policy {policy!r}; known: {', '.join(POLICY)}")
    return POLICY[policy].budgeted


@dataclass(frozen=True)
class RunBudget:
    """What the runtime is given: the budget and the per-layer budgets (``()``: ``m_max`` in every layer)."""

    m_max: int
    layers: tuple[int, ...] = ()

    def of(self, layer: int) -> int:
        """The budget of the prefetches into ``layer``."""
        return layer_budget(self.m_max, self.layers, layer)


def run_budget(policy: str, m_max: int, layer_m_max: Sequence[int] = ()) -> RunBudget:
    """The budget a run of ``policy`` uses: 0 and no per-layer budgets for a policy without one; per-layer budgets
    equal to ``m_max`` in every layer prefetched into are the one budget."""
    if not has_budget(policy):
        return RunBudget(0)
    layers = tuple(int(m) for m in layer_m_max)
    if all(m == int(m_max) for m in layers[1:]):
        layers = ()
    return RunBudget(int(m_max), layers)


def layer_budget(m_max: int, layer_m_max: Sequence[int], layer: int) -> int:
    """M_max of the prefetches into ``layer``: its per-layer budget when one is given, else ``m_max``."""
    return int(layer_m_max[layer]) if 0 <= layer < len(layer_m_max) else int(m_max)


__all__ = [
    "AUTO",
    "EWMA_ALPHA",
    "LAYER_RULE_KEYS",
    "RULE",
    "RULE_KEYS",
    "BudgetError",
    "EwmaBudget",
    "RunBudget",
    "allot_layer_budgets",
    "budget_rule",
    "budget_storages",
    "derive_m_max",
    "ewma_budgets",
    "has_budget",
    "is_auto",
    "layer_budget",
    "layer_budgets",
    "lookahead_budgets",
    "online_budget",
    "read_window_profile",
    "rule_budgets",
    "run_budget",
    "storage_budgets",
    "window_budgets",
]


def profiled_physical_ms(profile: dict[str, Any]) -> float:
    """The window profile's isolated cold read of one record (what its ``delay`` emulation's delays add to)."""
    cold = (profile.get("transfer_ms") or {}).get("nvme_cold") or {}
    ms = cold.get("transfer_ms")
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise SpecPrefetchError("profile.json has no measured nvme_cold transfer_ms: the delay emulation adds to the "
                                "physical read, so nvme_cold must be profiled")
    return float(ms)
