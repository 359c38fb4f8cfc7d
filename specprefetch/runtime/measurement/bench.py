"""Runtime benchmarks (paper §4.4: Tables 4-5, Figures 4-6): paired, interleaved, repeated decoding runs.

Experiments (the ``experiment`` column of ``runs.csv``), all on the same prompts:

- ``main`` (Table 4 + the all-resident bound): every policy of ``device.main_policies`` at the profiled
  ``M_max`` on the reference storage (cold NVMe);
- ``matched`` (Table 5): Naive Prefetch vs SpecPrefetch (and FATE) at the same ``M_max`` on the reference and the
  slow storage;
- ``sweep`` (Figure 4): SpecPrefetch at every ``device.sweep_m_max`` (and the profiled one) vs OFF, on the reference
  storage, or on each of ``device.sweep_storages``;
- ``storage`` (Figure 5): OFF vs SpecPrefetch on every storage profile;
- ``component`` (Figure 6): compute_opt off/on x prefetch off/on, reference storage (page cache evicted);
- ``budget``: OFF vs SpecPrefetch with the storage's one budget ``M_max`` vs with the per-layer budgets
  ``M_max,l = ⌊W_l / t_transfer⌋`` (the window profile's ``m_max_per_layer``), on every storage (column
  ``layer_m_max``; where every layer's budget equals ``M_max`` the two are one configuration, measured once);
- ``lookahead`` (beyond the paper): OFF vs SpecPrefetch prefetching ``d`` layers ahead (column ``lookahead``; a
  predictor trained at distance d, ``predictors.lookahead``) for every ``d`` of ``device.lookahead.distances``, on
  each of ``device.lookahead.storages``, at the window rule's budget on the window summed over d layers
  (:func:`~specprefetch.runtime.core.budget.lookahead_budgets`), and as its control SpecPrefetch one layer ahead
  at each of those budgets;
- ``batch`` (beyond the paper): OFF, SpecPrefetch and all-resident decoding a batch of ``B`` prompts (the first ``B``
  of the workload, left-padded: :func:`~specprefetch.runtime.measurement.decode.collate`) for every ``B`` of
  ``device.batch.sizes`` on each of ``device.batch.storages`` (column ``batch``), SpecPrefetch with the paper's batch
  priorities at the window rule's budget on the window measured at that batch size
  (:func:`~specprefetch.runtime.core.budget.batch_budgets`); each (storage, batch) is a block of its own, so its runs
  share one prefill and its pairs one host.

The blocks of :func:`storage_blocks` measure the plan: a block holds whole experiments of one storage and measures
every distinct configuration they run on it once per repeat, before repeat ``r+1`` starts: in lockstep, token by
token in a fresh random order every token (``device.interleave: token``, the default; see
:meth:`~specprefetch.runtime.measurement.session.Harness.run_lockstep`), or one run after another in a random order
(``run``).
A storage is one block, or, with ``device.max_block_runs``, several blocks of at most that many configurations, each
with its own OFF (on the physical disk a big lockstep block pairs worse: its runs' tokens lie further apart).
The blocks are measured in rounds (:func:`_measure_rounds`): round ``r`` measures repeat ``r`` of every block, in a
fresh random block order, so an experiment's repeats spread over the whole benchmark and a drift of the host hits
every block alike. Every block measures ``device.repeats`` repeats; with ``device.max_repeats`` it then goes on, one
round at a time, until every policy gain it measures has a 95 % CI half-width within ``device.target_ci_pp``
(:func:`widest_gain_ci`) or it has measured ``max_repeats`` (adaptive repeats: each block stops on its own).
An experiment's rows are its block's runs of the same repeat (column ``block``; ``measured_in`` names the block's
first experiment that lists the configuration), so every pair (Figure 6's across compute_opt too) comes from one
block. Gains are paired: ``tokens_per_s / tokens_per_s(off, same experiment, storage, compute_opt, repeat) - 1``.
Every run must decode exactly the tokens of the plain model's greedy ``generate()`` (every expert resident, no
runtime: :meth:`Harness.plain_generations`); the router decides, so a policy cannot change them; a run that does
is an error. Each run's tokens (``tokens_sha256``; the tokens themselves in the routing record), routing and
priorities are kept so the simulator can replay it. ``bound_tokens_per_s`` is the run's overlap bound
(:func:`overlap_bound`) with the all-resident compute, ``bound_own_tokens_per_s`` the same with the run's own.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specprefetch import registry
from specprefetch.contracts import POLICY, ROUTING_FORMAT, RUN_COLUMNS, save_tensor_tree, variant_experiment
from specprefetch.io import SpecPrefetchError, atomic_path, provenance
from specprefetch.metrics import bootstrap_ci
from specprefetch.runtime.core.budget import (
    EwmaBudget,
    batch_budgets,
    budget_scope,
    ewma_budgets,
    layer_budgets,
    lookahead_budgets,
    pre_attention_budgets,
    profiled_physical_ms,
    rule_budgets,
    run_budget,
    storage_budgets,
)
from specprefetch.runtime.measurement.session import Harness, RunResult

log = logging.getLogger(__name__)



# (policy, storage, budget, compute_opt, per-layer budgets or (), look-ahead, online budget rule or "", batch): what
# the runtime is given
Signature = tuple[str, str, int, bool, tuple[int, ...], int, str, int]
# budget rules beyond the paper a run can be named after (RunConfig.rule, runs.csv's budget_rule; "": the paper's
# window rule, per storage or per layer); the runtime applies ONLINE_RULES itself, step by step
EXTRA_RULES = registry.EXTRA_BUDGET_RULES
ONLINE_RULES = ("ewma",)


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    policy: str
    storage: str
    m_max: int
    compute_opt: bool = True
    layer_m_max: tuple[int, ...] = ()  # per-layer budgets (index: the layer prefetched into); (): m_max everywhere
    lookahead: int = 1  # layer l prefetches into layer l + lookahead (the paper: 1)
    rule: str = ""      # the budget rule beyond the paper that chose the budget (EXTRA_RULES; an online one's m_max is
    #                     its seed's budget); "": the paper's window rule (or a configured budget)
    batch: int = 1      # sequences decoded together (the paper: 1)

    def __post_init__(self) -> None:
        if self.rule and self.rule not in EXTRA_RULES:
            raise SpecPrefetchError(f"unknown budget rule {self.rule!r}; known: {', '.join(EXTRA_RULES)}")
        if self.batch < 1:
            raise SpecPrefetchError(f"run {self.experiment}/{self.policy}: batch must be >= 1, got {self.batch}")

    @property
    def key(self) -> str:
        per = f"|L{layer_budgets_label(self.layers)}" if self.layers else ""
        ahead = f"|d{self.ahead}" if self.ahead != 1 else ""
        online = f"|{self.online}" if self.online else ""
        batch = f"|b{self.batch}" if self.batch != 1 else ""
        return (f"{self.experiment}|{self.policy}|{self.storage}|{self.m_max}|{int(self.compute_opt)}{per}{ahead}"
                f"{online}{batch}")

    @property
    def label(self) -> str:
        """Short and human: ``specprefetch M=4``, ``off (no compute opt)``, ``specprefetch M=7 per layer 6/6/7``,
        ``specprefetch M=8 d=2``."""
        per = f" per layer {layer_budgets_label(self.layers)}" if self.layers else ""
        if self.budget_rule:
            per += f" ({self.budget_rule.upper()})"
        return (self.policy + (f" M={self.budget}" if self.budget else "") + per
                + (f" d={self.ahead}" if self.ahead != 1 else "") + ("" if self.compute_opt else " (no compute opt)")
                + (f" batch {self.batch}" if self.batch != 1 else ""))

    @property
    def ahead(self) -> int:
        """The look-ahead the runtime uses: 1 for a policy that does not predict."""
        return int(self.lookahead) if POLICY[self.policy].predicts else 1

    @property
    def budget(self) -> int:
        """The M_max the runtime uses (:func:`~specprefetch.runtime.core.budget.run_budget`: 0 for OFF, resident)."""
        return run_budget(self.policy, self.m_max, self.layer_m_max).m_max

    @property
    def layers(self) -> tuple[int, ...]:
        """The per-layer budgets the runtime uses: () when unbudgeted or every layer's equals ``m_max``."""
        return run_budget(self.policy, self.m_max, self.layer_m_max).layers

    @property
    def budget_rule(self) -> str:
        """runs.csv's ``budget_rule``: the rule beyond the paper, "" for a policy without a budget."""
        return self.rule if self.budget else ""

    @property
    def online(self) -> str:
        """The online budget rule the runtime uses: "" for a policy without a budget or a rule the runtime is given
        the budgets of."""
        return self.budget_rule if self.rule in ONLINE_RULES else ""

    @property
    def signature(self) -> Signature:
        """What the runtime is given, whatever the experiment."""
        return (self.policy, self.storage, self.budget, self.compute_opt, self.layers, self.ahead, self.online,
                int(self.batch))


def layer_budgets_label(budgets: tuple[int, ...]) -> str:
    """runs.csv's ``layer_m_max``: the per-layer budgets of layers 1..L-1 ("" for the one budget)."""
    return "/".join(str(m) for m in budgets[1:])


def run_lookahead(row: Any) -> int:
    """A runs.csv row's look-ahead (1 where the column is empty or absent: the paper's next-layer prefetch)."""
    text = _text(row.get("lookahead") if hasattr(row, "get") else None)
    return int(float(text)) if text else 1


def parse_layer_budgets(label: Any, m_max: int) -> tuple[int, ...]:
    """The inverse of :func:`layer_budgets_label` (index 0, never prefetched into, is ``m_max``)."""
    text = _text(label)
    return (int(m_max), *(int(m) for m in text.split("/"))) if text else ()


def run_batch(row: Any) -> int:
    """A runs.csv row's batch size (1 where the column is empty or absent: the paper's one sequence)."""
    text = _text(row.get("batch") if hasattr(row, "get") else None)
    return int(float(text)) if text else 1


def run_budget_rule(row: Any) -> str:
    """A runs.csv row's budget rule beyond the paper (``budget_rule``; "" where empty or absent: the paper's)."""
    return _text(row.get("budget_rule") if hasattr(row, "get") else None)


def row_signature(row: Any) -> Signature:
    """What the runtime was given in a runs.csv row (:attr:`RunConfig.signature`)."""
    m_max, rule = int(row["m_max"]), run_budget_rule(row)
    return (str(row["policy"]), str(row["storage"]), m_max, bool(row["compute_opt"]),
            parse_layer_budgets(row.get("layer_m_max"), m_max), run_lookahead(row),
            rule if rule in ONLINE_RULES else "", run_batch(row))


def _text(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v).strip()


def plan_experiments(settings: dict[str, Any], budgets: dict[str, int] | int, experiments: Iterable[str],
                     layer_m_max: dict[str, tuple[int, ...]] | None = None,
                     rule_m_max: dict[str, set[int]] | None = None,
                     ahead_m_max: dict[str, dict[int, int]] | None = None,
                     dp_m_max: dict[str, tuple[int, ...]] | None = None,
                     sim_m_max: dict[str, int] | None = None,
                     pre_m_max: dict[str, int] | None = None,
                     batch_m_max: dict[int, dict[str, int]] | None = None) -> dict[str, list[RunConfig]]:
    """The configurations of every experiment, each storage at its own budget ``budgets[storage]`` (an integer:
    the same budget everywhere) and, for ``budget``, its per-layer budgets ``layer_m_max[storage]``; the sweep
    measures ``device.sweep_m_max``, the storage's budget and every rule's (``rule_m_max[storage]``); ``lookahead``
    each distance at ``ahead_m_max[storage][d]``; ``budget`` also, with ``device.extra_rules``, the DP rule's per-layer
    budgets ``dp_m_max[storage]``, the online EWMA rule and the simulated rule's budget ``sim_m_max[storage]``;
    ``pre_attention`` the pre-attention policy at its own budget ``pre_m_max[storage]`` (its window: the attention)
    and at SpecPrefetch's, beside SpecPrefetch and OFF, on the reference and the slow storage; ``batch`` OFF,
    SpecPrefetch at ``batch_m_max[B][storage]`` and all-resident for every batch size ``B`` of ``device.batch``
    (:mod:`~specprefetch.runtime.core.budget` decides them all)."""
    ref, slow = settings["reference_storage"], settings["slow_storage"]
    m_max = budgets if isinstance(budgets, dict) else defaultdict(lambda: int(budgets))
    per_layer = layer_m_max or {}
    out: dict[str, list[RunConfig]] = {}
    for exp in experiments:
        if exp == "main":
            pols = ["off", *[p for p in settings["main_policies"] if p != "off"]]
            out[exp] = [RunConfig(exp, p, ref, m_max[ref]) for p in pols]
        elif exp == "matched":
            pols = ["off", *[p for p in settings["matched_policies"] if p != "off"]]
            out[exp] = [RunConfig(exp, p, st, m_max[st]) for st in dict.fromkeys([ref, slow]) for p in pols]
        elif exp == "sweep":
            out[exp] = []
            for st in settings.get("sweep_storages") or [ref]:
                ms = sorted({int(m) for m in settings["sweep_m_max"]} | {m_max[st]} | (rule_m_max or {}).get(st, set()))
                out[exp] += [RunConfig(exp, "off", st, 0)] + [RunConfig(exp, "specprefetch", st, m) for m in ms]
        elif exp == "storage":
            out[exp] = [RunConfig(exp, p, st, m_max[st]) for st in settings["storages"]
                        for p in ("off", "specprefetch")]
        elif exp == "component":
            out[exp] = [RunConfig(exp, p, ref, m_max[ref], opt) for opt in (False, True)
                        for p in ("off", "specprefetch")]
        elif exp == "budget":
            extra = settings.get("extra_rules") or []
            out[exp] = []
            for st in dict.fromkeys([ref, slow, *settings["storages"]]):
                m = m_max[st]
                runs = [("off", m, (), ""), ("specprefetch", m, (), ""), ("specprefetch", m, per_layer.get(st, ()), "")]
                if "dp" in extra:
                    runs.append(("specprefetch", m, _rule_budget(dp_m_max, st, "dp"), "dp"))
                if "ewma" in extra:
                    runs.append(("specprefetch", m, (), "ewma"))
                if "simulated" in extra:
                    runs.append(("specprefetch", _rule_budget(sim_m_max, st, "simulated"), (), "simulated"))
                out[exp] += [RunConfig(exp, p, st, mm, True, lb, rule=rule) for p, mm, lb, rule in runs]
            # per-layer budgets equal to the one budget: one run; a rule beyond the paper that chose the budgets of
            # another run is a row of that run under its own name
            out[exp] = list({(c.signature, c.rule): c for c in out[exp]}.values())
        elif exp == "lookahead":
            ahead = settings.get("lookahead") or {}
            if not ahead_m_max:
                raise SpecPrefetchError("experiment 'lookahead' needs the budgets per distance (the window profile)")
            ds = [int(d) for d in ahead.get("distances", [1])]
            # each d at its budget, and the control: d = 1 at that same budget (does the longer window pay, or the
            # larger budget?); a control equal to a run of the list is that run
            out[exp] = list({c.signature: c for st in ahead.get("storages", [ref]) for c in (
                RunConfig(exp, "off", st, 0),
                *(RunConfig(exp, "specprefetch", st, ahead_m_max[st][d], lookahead=d) for d in ds),
                *(RunConfig(exp, "specprefetch", st, ahead_m_max[st][d]) for d in ds if d != 1))}.values())
        elif exp == "pre_attention":
            if not pre_m_max:
                raise SpecPrefetchError("experiment 'pre_attention' needs its budgets per storage (the window profile)")
            # its own budget and the control, SpecPrefetch's budget (does the earlier input pay, or the budget?)
            out[exp] = list({c.signature: c for st in dict.fromkeys([ref, slow]) for c in (
                RunConfig(exp, "off", st, 0), RunConfig(exp, "specprefetch", st, m_max[st]),
                RunConfig(exp, "pre_attention", st, pre_m_max[st]),
                RunConfig(exp, "pre_attention", st, m_max[st]))}.values())
        elif exp == "batch":
            if not batch_m_max:
                raise SpecPrefetchError("experiment 'batch' needs its budgets per batch size (the window profile)")
            bcfg = settings["batch"]
            out[exp] = [RunConfig(exp, p, st, m, batch=int(b)) for st in bcfg["storages"] for b in bcfg["sizes"]
                        for p, m in (("off", 0), ("specprefetch", batch_m_max[int(b)][st]), ("resident", 0))]
        else:
            raise SpecPrefetchError(f"unknown experiment {exp!r}")
    return out


def _rule_budget(table: dict[str, Any] | None, storage: str, rule: str) -> Any:
    """The budget (or per-layer budgets) ``rule`` gives ``storage``, from the window profile."""
    if not table or storage not in table:
        raise SpecPrefetchError(f"device.extra_rules has {rule!r}, but the window profile has no {rule}-rule budget "
                                f"for {storage} (the budget must be auto by the window rule): rerun profile-window")
    return table[storage]


@dataclass(frozen=True)
class Block:
    """Configurations measured together, once per repeat (:func:`measure_block`), and the experiments whose runs on
    ``storage`` they are."""
    name: str
    storage: str
    configs: tuple[RunConfig, ...]
    experiments: tuple[str, ...]
    batch: int = 1  # the sequences every configuration of the block decodes together (they share one prefill)


def storage_blocks(plan: dict[str, list[RunConfig]], max_runs: int | None = None) -> list[Block]:
    """The blocks that measure ``plan``: per storage, the distinct configurations (by :attr:`RunConfig.signature`)
    its experiments run on it, each once per block, as the first experiment of the block (in plan order) that lists
    it.

    A batch size other than 1 (the ``batch`` experiment) is a storage of its own here: its blocks are named
    ``<storage>@b<B>`` (a block's runs decode one batch, from one shared prefill).

    Without ``max_runs`` a storage is one block (named after it). With it, a storage's experiments are packed whole,
    in plan order, into the first of its blocks that they keep at ``max_runs`` distinct configurations or fewer (an
    experiment the block already covers joins it for free; one larger than ``max_runs`` gets a block of its own), so
    each block runs its own OFF and an experiment's pairs always come from one block. A storage's later blocks are
    named ``<storage>#2``, ``<storage>#3``, ..."""
    groups: dict[tuple[str, int], list[tuple[dict[Signature, RunConfig], list[str]]]] = {}
    for name, configs in plan.items():
        by_storage: dict[tuple[str, int], dict[Signature, RunConfig]] = {}
        for c in configs:
            by_storage.setdefault((c.storage, c.batch), {}).setdefault(c.signature, c)
        for st, exp in by_storage.items():
            blocks = groups.setdefault(st, [])
            fit = next((b for b in blocks if max_runs is None or exp.keys() <= b[0].keys()
                        or len(b[0].keys() | exp.keys()) <= max_runs), None)
            if fit is None:
                blocks.append((dict(exp), [name]))
                continue
            for sig, c in exp.items():
                fit[0].setdefault(sig, c)
            fit[1].append(name)
    return [Block(_block_name(st, batch, i), st, tuple(b.values()), tuple(exps), batch)
            for (st, batch), blocks in groups.items() for i, (b, exps) in enumerate(blocks)]


def _block_name(storage: str, batch: int, i: int) -> str:
    """``<storage>``, ``<storage>@b<B>`` for a batch, ``#<n>`` for a storage's later blocks."""
    return storage + (f"@b{batch}" if batch != 1 else "") + (f"#{i + 1}" if i else "")


def tokens_sha256(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def overlap_bound(events: list[Any], comp: dict[str, Any] | None, transfer_ms: float | None) -> float:
    """A run's roofline throughput (tok/s): every decoding layer takes ``max(compute, transfers)`` with perfect
    overlap, where compute is the layer's measured all-resident time (a compute profile: bookkeeping, prediction and
    expert compute, plus the gap to the next layer) and transfers are the loads this run could not avoid (its demand
    loads and the prefetches its layer used) at the storage's measured per-expert transfer time; plus the per-token
    head. NaN without a compute profile or transfer time. (The bound is optimistic: it takes the smallest per-expert
    transfer time measured for the storage, :func:`set_bounds`.)"""
    if not comp or transfer_ms is None:
        return float("nan")
    t = float(transfer_ms) * 1e-3
    per_layer = [b + m + g for b, m, g in zip(comp["book_s"], comp["moe_s"], comp["gap_s"])]
    total, steps = 0.0, {}
    for ev in events:
        if not ev.decode or ev.step == 0:
            continue  # prefill and the first token are not decoding time (decode.py)
        steps[ev.step] = ev.n_tokens  # a step decodes one token of each sequence of the batch
        loads = ev.misses + max(ev.inflight, ev.prefetch_used)  # in flight at t_exec: prefetches it used
        total += max(per_layer[ev.layer] if ev.layer < len(per_layer) else 0.0, loads * t)
    total += len(steps) * float(comp.get("head_s", 0.0))
    return sum(steps.values()) / total if total > 0 else float("nan")


def set_bounds(rows: list[dict[str, Any]], events_of: dict[tuple[str, int, Signature], list[Any]],
               profile: dict[str, Any], n_layers: int,
               timings_of: dict[tuple[str, int, Signature], dict[str, Any]] | None = None) -> None:
    """Fill ``bound_tokens_per_s`` of every row (:func:`overlap_bound`). The compute of repeat ``r`` is the
    all-resident run of the same repeat and batch size (measured in the same block, so the bound sees the host as the
    run did); without one, and for ``compute_opt`` off, the window profile's compute profile (one sequence's: a batch
    without its all-resident run has no bound). Per-expert transfer time: the
    smallest of the window profile's for the storage (isolated and in the runtime) and, with ``timings_of``
    (:func:`run_timing` of each run), the run's own service time (a run with few transfers in flight may be served
    faster than the profile's run at M = K; the bound must not be beaten). With ``timings_of`` also
    ``bound_own_tokens_per_s``: the same bound with the run's own measured compute, so the gap to the
    bound splits into compute the offloaded run lost (the host's cores and memory shared with its transfers) and
    the transfers it left exposed."""
    from specprefetch.runtime.measurement.window import compute_profile

    resident = {(r, sig[7]): compute_profile(evs, n_layers) for (exp, r, sig), evs in events_of.items()
                if sig[0] == "resident" and sig[3]}
    t_used = profile.get("transfer_ms_used") or {}
    for row in rows:
        sig = row_signature(row)
        evs = events_of.get((row["measured_in"], int(row["repeat"]), sig))
        if evs is None:
            continue
        comp = resident.get((int(row["repeat"]), sig[7])) if row["compute_opt"] else None
        if sig[7] == 1:  # the window profile's compute is one sequence's
            comp = comp or profile.get("compute", {}).get("opt" if row["compute_opt"] else "loop")
        own = (timings_of or {}).get((row["measured_in"], int(row["repeat"]), sig))
        times = [t for t in (t_used.get(row["storage"]),
                             profile.get("transfer_ms", {}).get(row["storage"], {}).get("transfer_ms"),
                             (own or {}).get("service_ms"))
                 if t is not None and math.isfinite(t)]
        t = min(times) if times else None
        row["bound_tokens_per_s"] = overlap_bound(evs, comp, t)
        if own is not None:
            row["bound_own_tokens_per_s"] = overlap_bound(evs, own["compute"], t)


def run_row(res: RunResult, cfg: RunConfig, repeat: int, platform: str, model: str, layout: Any,
            tokens_match: bool, bound: float) -> dict[str, Any]:
    st = res.stats
    record_bytes = layout.record_bytes
    return {
        "platform": platform, "model": model, "experiment": cfg.experiment, "policy": cfg.policy,
        "storage": cfg.storage, "m_max": res.m_max, "compute_opt": cfg.compute_opt, "repeat": repeat,
        "tokens_per_s": res.tokens_per_s, "ready_recall": st.ready_recall, "n_tokens": res.n_tokens,
        "hits": st.hits, "misses": st.misses, "prefetched": st.prefetched, "wasted": st.wasted,
        "stall_ms": st.stall_ms, "source": "measured", "inflight": st.inflight, "cancelled": st.cancelled,
        "demand_loads": st.demand_loads, "io_errors": st.io_errors, "peak_cache_experts": st.peak_cache_experts,
        "capacity_experts": res.capacity, "peak_cache_bytes": st.peak_cache_experts * record_bytes,
        "capacity_bytes": res.capacity * record_bytes, "decode_s": res.decode_s, "record_bytes": record_bytes,
        "expert_format": layout.quant if layout.quant != "none" else str(layout.dtype).removeprefix("torch."),
        "tokens_match": tokens_match, "tokens_sha256": tokens_sha256(res.tokens()), "bound_tokens_per_s": bound,
        "measured_in": cfg.experiment, "layer_m_max": layer_budgets_label(cfg.layers), "lookahead": cfg.ahead,
        "budget_rule": cfg.budget_rule, "m_max_mean": mean_budget(res.events), "batch": cfg.batch,
    }


def mean_budget(events: Iterable[Any]) -> float:
    """The mean budget of a run's decoding prediction steps (NaN: it predicted nothing): the budget as given, or what
    an online rule chose step by step."""
    ms = [ev.m_max for ev in events if ev.decode and ev.m_max is not None]
    return sum(ms) / len(ms) if ms else float("nan")


def against_trained(res: RunResult, trained: list[tuple[list[int], list[torch.Tensor]]] | None) -> dict[str, Any]:
    """A run against the trained model's own greedy decode (:meth:`Harness.trained_reference`): whether its tokens are
    the trained model's, and in how many of the (token, MoE layer) expert sets it routed differently (the store's
    widened 4-bit experts move hidden states by rounding, which flips near-tied top-k choices) out of how many.
    Empty where there is no reference (CUDA)."""
    if trained is None:
        return {}
    match = res.tokens() == [t for t, _ in trained]
    n_layers = len(trained[0][1])
    ref = [torch.cat([topk[layer] for _, topk in trained]) for layer in range(n_layers)]
    got: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    for ev in res.events:
        if ev.topk is not None and ev.layer < n_layers:
            got[ev.layer].append(ev.topk.reshape(-1, ev.topk.shape[-1]).long())
    differ = total = 0
    for layer in range(n_layers):
        if not got[layer]:
            continue
        run = torch.cat(got[layer])
        n = min(len(run), len(ref[layer]))  # aligned at the end: a lockstep block may prefill once for all its runs
        a, b = run[-n:].sort(dim=-1).values, ref[layer][-n:].long().sort(dim=-1).values
        differ += int((a != b).any(dim=-1).sum())
        total += n
    return {"tokens_match_trained": match, "routing_diff_trained": differ, "routing_sets": total}


def recorded_routing(res: RunResult) -> list[dict[str, Any]]:
    """The run's per-event routing and priorities, compactly (the simulator's replay input)."""
    return [{"step": ev.step, "layer": ev.layer, "topk": ev.topk.to(torch.int16) if ev.topk is not None else None,
             "scores": ev.scores.float() if ev.scores is not None else None} for ev in res.events]


def run_timing(res: RunResult, n_layers: int) -> dict[str, Any]:
    """What the host gave the run, as the simulator's inputs (``validate_simulator``'s ``run`` inputs): the run's own
    per-layer compute durations (:func:`~specprefetch.runtime.measurement.window.compute_profile` of its events, stalls
    excluded), the mean duration of its transfers during decoding (read start to slot filled) and its per-expert
    service time (the time some transfer was running, divided by their number: what one expert costs the device when
    transfers overlap); NaN with no transfer; and the mean thread hand-offs of the loads a worker served
    (``wake_ms``, back to the compute thread that waited; ``start_ms``, to a worker that slept:
    :func:`~specprefetch.runtime.measurement.window.hand_offs`; 0 with none)."""
    from specprefetch.runtime.measurement.window import busy_s, compute_profile, decoding_transfers, hand_offs

    transfers = decoding_transfers(res)
    n = len(transfers)
    return {"compute": compute_profile(res.events, n_layers), "n_transfers": n,
            "transfer_ms": sum(tr.t_end - tr.t_start for tr in transfers) / n * 1e3 if n else float("nan"),
            "service_ms": busy_s(transfers) / n * 1e3 if n else float("nan"),
            **{ms: statistics.fmean(got) if got else 0.0 for ms, got in hand_offs(res).items()}}


def widest_gain_ci(configs: Iterable[RunConfig], tps: dict[Signature, list[float]]) -> tuple[float, str]:
    """The widest 95 % CI half-width (percent points; ``metrics.bootstrap_ci``, the tables' paired bootstrap
    over repeats) of the gains one block has measured so far, and which gain it is: every configuration but
    all-resident (a reference, not a policy's gain) against every OFF of the block, ``tps`` holding each
    configuration's tokens/s per repeat. ``(0.0, "")`` when there is no such pair."""
    configs = list(configs)
    widest, what = 0.0, ""
    for ref in (c for c in configs if c.policy == "off"):
        base = tps[ref.signature]
        for c in configs:
            if c.signature == ref.signature or c.policy == "resident":
                continue
            gains = [(v / b - 1.0) * 100.0 for v, b in zip(tps[c.signature], base, strict=True)]
            width = bootstrap_ci(gains).half_width
            if width > widest:
                widest, what = width, f"{c.label} vs {ref.label}"
    return widest, what


def block_order(configs: list[RunConfig], seed: int, block: str, repeat: int) -> list[RunConfig]:
    """The configurations of one (block, repeat) in a random order, seeded by (seed, block, repeat): reproducible,
    different in every block, and the same in a rerun."""
    order = list(configs)
    random.Random(f"specprefetch/bench/{seed}/{block}/{repeat}").shuffle(order)
    return order


def measure_block(harness: Harness, configs: dict[int, RunConfig], lockstep: bool, seed: str,
                  online: dict[str, EwmaBudget] | None = None) -> dict[int, RunResult]:
    """The runs of one (experiment, repeat) block, by position: one after another in the block's order, or, with
    ``lockstep``, all at once, token by token in a random order every token (:meth:`Harness.run_lockstep`).
    ``online``: per storage, the seeded online rule of the runs that use one (:func:`ewma_budgets`). The block's
    configurations decode one batch size, its prompts :meth:`Harness.batch_prompts`."""
    batches = {c.batch for c in configs.values()}
    if len(batches) > 1:
        raise SpecPrefetchError(f"a block decodes one batch size, not {sorted(batches)}")
    prompts = harness.batch_prompts(batches.pop()) if batches else None
    kwargs = {pos: {"policy": c.policy, "storage": c.storage, "m_max": c.m_max, "compute_opt": c.compute_opt,
                    "record": True, "layer_m_max": c.layers, "lookahead": c.ahead,
                    "ewma": _online_of(c, online)} for pos, c in configs.items()}
    if lockstep and kwargs:
        return dict(zip(kwargs, harness.run_lockstep(list(kwargs.values()), seed=seed, prompts=prompts)))
    return {pos: harness.run(**kw, prompts=prompts) for pos, kw in kwargs.items()}


def _online_of(cfg: RunConfig, online: dict[str, EwmaBudget] | None) -> EwmaBudget | None:
    """The seeded online rule a run uses (None: its budget as given)."""
    if not cfg.online:
        return None
    if not online or cfg.storage not in online:
        raise SpecPrefetchError(f"run {cfg.key} uses the online {cfg.online} budget, which needs the window profile's "
                                f"window and transfer time of {cfg.storage}")
    return online[cfg.storage]


def bench_runtime(harness: Harness, profile: dict[str, Any], model: str, platform: str, out_csv: str | Path,
                  experiments: Iterable[str] | None = None, routing_out: str | Path | None = None,
                  config_fragment: Any = None, seed: int = 0, variant: str | None = None) -> list[dict[str, Any]]:
    """Run every experiment and write ``out_csv`` (one row per run and experiment); returns the rows. ``variant``
    (of ``device.variants``, whose settings the harness has): its rows are named ``<experiment>@<variant>``.

    Round by round (every block's repeat ``r`` before any block's repeat ``r + 1``, blocks in a seeded random order),
    each (block, repeat)'s configurations (:func:`storage_blocks`), in a seeded random order (``block_order``; column
    ``run_order`` is a run's position), are measured by :func:`measure_block`: in lockstep, or one after another in
    that order, so no policy is always first (or always right after the warm-up).
    """
    if "nvme_cold" in (profile.get("transfer_ms") or {}):
        # the delay emulation adds to the physical read the window profile measured (its budgets' base too)
        harness.use_physical_ms(profiled_physical_ms(profile))
    plan, blocks = _plan_blocks(harness.settings, profile, experiments)
    plain = _warm_up(harness)
    n_runs = sum(len(b.configs) for b in blocks) * int(harness.settings["repeats"])
    rec = _Recorder(harness, plain, model, platform, n_runs, harness.trained_reference())
    online = (ewma_budgets(profile, harness.store.n_experts) if any(c.online for b in blocks for c in b.configs)
              else None)
    n_repeats = _measure_rounds(harness, blocks, rec, seed, online)
    rows = _experiment_rows(plan, blocks, rec, n_repeats)
    set_bounds(rows, rec.events_of, profile, harness.store.n_layers, rec.timings_of)
    measured_under = {"emulation": harness.settings["emulation"], "io_order": harness.settings["io_order"],
                      "budget_scope": budget_scope(harness.settings)}
    for row in rows:
        row["experiment"] = variant_experiment(row["experiment"], variant)
        row["measured_in"] = variant_experiment(row["measured_in"], variant)
        row |= measured_under
    write_runs_csv(out_csv, rows)
    if routing_out is not None:
        save_tensor_tree(routing_out, {"model": model, "platform": platform, "capacity": harness.capacity,
                                       "plain_tokens": torch.tensor(plain, dtype=torch.int64), "runs": rec.routing,
                                       "provenance": provenance(config_fragment)}, ROUTING_FORMAT)
    return rows


def _plan_blocks(settings: dict[str, Any], profile: dict[str, Any],
                 experiments: Iterable[str] | None) -> tuple[dict[str, list[RunConfig]], list[Block]]:
    """The plan (each storage at its budget from :mod:`~specprefetch.runtime.core.budget`) and its blocks."""
    m_max = storage_budgets(settings, profile)
    exps = list(experiments or settings["experiments"])
    ahead = settings.get("lookahead") or {}
    ahead_m = (lookahead_budgets(settings, profile, {st: m_max[st] for st in ahead.get("storages", [])},
                                 ahead.get("distances", [1])) if "lookahead" in exps else None)
    extra = settings.get("extra_rules") or []
    sim_m = (storage_budgets({**settings, "budget_rule": "simulated"}, profile, list(m_max))
             if "simulated" in extra and "budget" in exps else None)
    pre_m = (pre_attention_budgets(settings, profile, {st: m_max[st] for st in (settings["reference_storage"],
                                                                             settings["slow_storage"])})
             if "pre_attention" in exps else None)
    batch_m = batch_budgets(settings, profile, m_max) if "batch" in exps else None
    plan = plan_experiments(settings, m_max, exps, layer_budgets(settings, profile, m_max),
                            rule_budgets(settings, profile), ahead_m, layer_budgets(settings, profile, m_max, "dp"),
                            sim_m, pre_m, batch_m)
    blocks = storage_blocks(plan, settings["max_block_runs"])
    repeats = int(settings["repeats"])
    max_repeats = int(settings["max_repeats"] or repeats)
    if max_repeats > repeats:
        log.info("adaptive repeats: %d to %d per block, until every gain's 95 %% CI is within +-%g pp", repeats,
                 max_repeats, float(settings["target_ci_pp"]))
    log.info("%d runs in %d blocks per repeat (%s) for %s", sum(len(b.configs) for b in blocks) * repeats,
             len(blocks), ", ".join(f"{b.name}: {len(b.configs)}" for b in blocks),
             ", ".join(f"{k} ({len(v)} configs)" for k, v in plan.items()))
    return plan, blocks


def _warm_up(harness: Harness) -> list[list[int]]:
    """Warm up (allocator, lazy module init, the store's page table; not recorded); the plain model's tokens."""
    harness.run("resident", "ram", max_new_tokens=4, prompts=harness.prompts[:1])
    harness.run("off", harness.settings["reference_storage"], max_new_tokens=4, prompts=harness.prompts[:1])
    plain = harness.plain_tokens()
    log.info("plain model: %d prompts x %d new tokens (sha256 %s)", len(plain), len(plain[0]) if plain else 0,
             tokens_sha256(plain)[:12])
    return plain


# (block or experiment, repeat, signature)
RunKey = tuple[str, int, Signature]


class _Recorder:
    """Every measured run of one benchmark: its row per (block, repeat, signature), its events and timing per
    (experiment, repeat, signature), and the routing record (one per configuration, with every repeat's row)."""

    def __init__(self, harness: Harness, plain: list[list[int]], model: str, platform: str, n_runs: int,
                 trained: list[tuple[list[int], list[torch.Tensor]]] | None = None) -> None:
        self.harness, self.plain, self.model, self.platform = harness, plain, model, platform
        self.plain_batched: dict[int, list[list[int]]] = {1: plain}
        self.trained = trained
        self.rows: dict[RunKey, dict[str, Any]] = {}
        self.events_of: dict[RunKey, list[Any]] = {}
        self.timings_of: dict[RunKey, dict[str, Any]] = {}
        self.routing: dict[str, Any] = {}
        self.done, self.n_runs = 0, n_runs

    def plain_of(self, batch: int) -> list[list[int]]:
        """The plain model's greedy tokens of the prompts a run of ``batch`` decodes (a batch: its own batched
        ``generate()``, computed once)."""
        if batch not in self.plain_batched:
            self.plain_batched[batch] = self.harness.plain_tokens(self.harness.batch_prompts(batch))
        return self.plain_batched[batch]

    def add(self, block: str, r: int, pos: int, cfg: RunConfig, res: RunResult) -> None:
        """Record one run (an error if it decoded other tokens than the plain model)."""
        self.done += 1
        match = res.tokens() == self.plain_of(cfg.batch)
        if not match:
            raise SpecPrefetchError(f"{self.model}: run {cfg.key} repeat {r} decoded other tokens than the plain "
                                    "model's greedy generate(); the offloaded runtime must not change outputs")
        # the trained model's reference decodes the benchmark's prompts one by one: batch 1 only
        trained = against_trained(res, self.trained) if cfg.batch == 1 else {}
        row = {**run_row(res, cfg, r, self.platform, self.model, self.harness.store.layout, match, float("nan")),
               "run_order": pos, "block": block, **trained}
        self.rows[(block, r, cfg.signature)] = row
        self.events_of[(cfg.experiment, r, cfg.signature)] = res.events
        self.timings_of[(cfg.experiment, r, cfg.signature)] = timing = run_timing(res, self.harness.store.n_layers)
        if r == 0:  # routing and priorities are the same in every repeat (same tokens): record one
            self.routing[cfg.key] = {"row": row, "events": recorded_routing(res), "repeats": [],
                                     "timings": [], "tokens": torch.tensor(res.tokens(), dtype=torch.int64)}
        self.routing[cfg.key]["repeats"].append(row)
        self.routing[cfg.key]["timings"].append(timing)
        log.info("[%d/%d] %s r%d: %.2f tok/s", self.done, self.n_runs, cfg.key, r, res.tokens_per_s)


def round_order(blocks: list[Block], seed: int, r: int) -> list[Block]:
    """The blocks of round ``r`` in a random order, seeded by (seed, round): reproducible, different every round."""
    order = list(blocks)
    random.Random(f"specprefetch/bench/{seed}/round/{r}").shuffle(order)
    return order


def _measure_rounds(harness: Harness, blocks: list[Block], rec: _Recorder, seed: int,
                    online: dict[str, EwmaBudget] | None = None) -> dict[str, int]:
    """Measure the blocks in rounds: round ``r`` measures repeat ``r`` of every block still measuring, in a fresh
    random block order, before any block's repeat ``r + 1``. So each experiment's repeats are spread over the whole
    benchmark and a drift of the host (the disk, the CPU) hits every block alike, instead of one block measuring
    while the disk was fast and the next while it was slow. After ``device.repeats`` rounds (adaptive repeats,
    ``device.max_repeats``) a block keeps measuring, one round at a time, while some gain's CI is wider than
    ``device.target_ci_pp``. Returns the repeats each block measured."""
    settings = harness.settings
    repeats = int(settings["repeats"])
    max_repeats = int(settings["max_repeats"] or repeats)
    target = float(settings["target_ci_pp"])
    lockstep = settings["interleave"] == "token"
    n = {b.name: 0 for b in blocks}
    active = list(blocks)
    for r in range(max_repeats):
        if not active:
            break
        for b in round_order(active, seed, r):
            order = block_order(list(b.configs), seed, b.name, r)
            results = measure_block(harness, dict(enumerate(order)), lockstep, f"{seed}/{b.name}/{r}", online)
            for pos, cfg in enumerate(order):
                rec.add(b.name, r, pos, cfg, results[pos])
            n[b.name] = r + 1
        if r + 1 < repeats or r + 1 == max_repeats:
            continue
        still = []
        for b in active:
            tps = {c.signature: [rec.rows[(b.name, q, c.signature)]["tokens_per_s"] for q in range(r + 1)]
                   for c in b.configs}
            width, what = widest_gain_ci(b.configs, tps)
            if width <= target:
                log.info("block %s: every gain within +-%.2f pp after %d repeats", b.name, width, r + 1)
                continue
            still.append(b)
            rec.n_runs += len(b.configs)
            log.info("block %s: +-%.2f pp (%s) after %d repeats: one more", b.name, width, what, r + 1)
        active = still
    return n


def _experiment_rows(plan: dict[str, list[RunConfig]], blocks: list[Block], rec: _Recorder,
                     n_repeats: dict[str, int]) -> list[dict[str, Any]]:
    """runs.csv's rows: every experiment's configurations, each repeat its block measured, from that block's run."""
    block_of = {(exp, b.storage, b.batch): b.name for b in blocks for exp in b.experiments}
    return [{**rec.rows[(block_of[(exp, c.storage, c.batch)], r, c.signature)], "experiment": exp,
             "budget_rule": c.budget_rule}
            for exp, configs in plan.items() for r in range(max(n_repeats.values(), default=0)) for c in configs
            if r < n_repeats[block_of[(exp, c.storage, c.batch)]]]


def write_runs_csv(path: str | Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    cols = list(columns or RUN_COLUMNS)
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, lineterminator="\n", restval="")
            w.writeheader()
            for r in rows:
                w.writerow({k: _fmt(v) for k, v in r.items()})


def _fmt(v: Any) -> Any:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


