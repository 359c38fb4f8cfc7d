"""The paper's claims as data: ``config/reference/claims.yaml`` loaded, checked and evaluated by one small engine.

Each claim names its table or figure, a ``kind`` (what it says: a count of settings, a sign, a tolerance, a
comparison of two cells, a sweep that rises or peaks ...) and its operands by stable ids (methods, policies,
storages, budget roles, columns), which the engine maps to the labels the table JSON cells carry
(``config.METHOD_LABELS``, ``render.style``'s policy labels and storage order). A table claim is evaluated by the
same function on the reproduced cells and on the paper's (``render.reported``); a figure claim on the reproduced
cells, against the paper's in-text numbers it quotes.

Device claims (their cells come from measured runs) are decided by the 95 % paired-bootstrap CI their cells carry
(``metrics.bootstrap_ci``): e.g. "gain > 0" holds iff lo > 0, fails iff hi < 0, and is otherwise
``Verdict.UNRESOLVED``; a comparison of two cells uses the CI of their per-repeat difference. The paper's cells have
no CI (mean ± std) and are judged by their values. Count claims hold only with the count the paper states.

Recall count claims (Tables 1-2) are decided the same way over training seeds: in each setting the paired
difference (same seed index, workload and budget; a training-free method's one value pairs with every seed) has a
95 % t-interval (``render.cells.seed_ci``), and a method "beats" another only where it excludes 0 (above), is beaten
only where it excludes 0 below, and is tied otherwise. A claim that holds counting only decided settings holds; one
that fails even with every tie counted for it fails; otherwise its verdict depends on the ties and is unresolved.
Cells without per-seed values (one seed, the paper's) are compared by their values at the printed precision.

A run's CI says what the run measured at its hour; the host's hour moves some effects by more than that (the disk,
the CPU's clock). With kept runs (``render.kept_runs``: earlier fresh DAGs' comparison.json on the same kind of host)
a device claim is judged across hours (``across_runs``): each effect's CI is widened by the spread between the runs,
the kept ones and this one (``Spread``), and ``verdict_run`` keeps the run's own verdict.

A malformed claims file (unknown kind, missing operand, unknown id) is one ``ClaimsError`` line naming the claim
and the key.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from specprefetch.config import METHOD_LABELS, REPO_ROOT
from specprefetch.contracts import LATENCY_MODES, ContractError, read_doc
from specprefetch.io import SpecPrefetchError
from specprefetch.metrics import CI, CI_LEVEL, bootstrap_ci
from specprefetch.render import style
from specprefetch.render.cells import Cell, TableDoc, seed_ci, t_quantile
from specprefetch.render.reported import Reported
from specprefetch.render.targets import CLAIMS, FIGURE_NAMES, TABLE_NAMES

CLAIMS_FORMAT = "specprefetch-claims/1"
DEFAULT_CLAIMS = REPO_ROOT / CLAIMS
CLAIMS_SCHEMA = REPO_ROOT / "workflow" / "schemas" / "claims.schema.yaml"
_PCT = f"{CI_LEVEL * 100:g} %"


class ClaimsError(SpecPrefetchError):
    """The claims file is malformed or names an unknown id; the message names the claim and the key."""


# --------------------------------------------------------------------------------------------- verdicts


class Verdict(str, Enum):
    """Whether a claim holds: decided either way, undecided by the measurements' 95 % CI, or not applicable
    (informational, or nothing to evaluate)."""

    HOLDS = "holds"
    FAILS = "fails"
    UNRESOLVED = "unresolved"
    NA = "n/a"

    @staticmethod
    def of(x: bool | Verdict | None) -> Verdict:
        if isinstance(x, Verdict):
            return x
        return Verdict.NA if x is None else (Verdict.HOLDS if x else Verdict.FAILS)

    @property
    def holds(self) -> bool | None:
        """True / False when decided, None when unresolved or not applicable."""
        return {Verdict.HOLDS: True, Verdict.FAILS: False}.get(self)


@dataclass
class Claim:
    """A statement of the paper, evaluated on the reproduced and on the reported numbers.

    A device claim (its reproduced value comes from measured runs) is decided by the 95 % bootstrap CI of its
    cells: ``Verdict.UNRESOLVED`` when the CI does not exclude the opposite outcome, with ``reason`` saying why.
    ``holds_*`` are True/False only for a decided verdict; ``agrees`` only when both sides are decided. ``doc`` is
    the table or figure it is about (``source`` is its printed name)."""

    id: str
    source: str  # "Table 1", "Figure 4", ...
    statement: str
    reproduced: str
    paper: str
    verdict_reproduced: Verdict
    verdict_paper: Verdict
    reason: str = ""
    device: bool = False
    doc: str = ""
    extension: bool = False  # beyond the paper: no paper side, kept apart from the paper's claims
    tests: tuple[Test, ...] = ()  # the CI decisions of a device claim's reproduced verdict (comparison.json keeps them)
    verdict_run: Verdict | None = None  # judged across runs (``across_runs``): the verdict of this run's own CIs
    spreads: tuple[Spread | None, ...] = ()  # per test: the kept runs' spread its CI was widened by (None: too few)

    def __post_init__(self) -> None:
        self.verdict_reproduced = Verdict.of(self.verdict_reproduced)
        self.verdict_paper = Verdict.of(self.verdict_paper)
        if self.verdict_run is not None:
            self.verdict_run = Verdict.of(self.verdict_run)

    @property
    def holds_reproduced(self) -> bool | None:
        return self.verdict_reproduced.holds

    @property
    def holds_paper(self) -> bool | None:
        return self.verdict_paper.holds

    @property
    def agrees(self) -> bool | None:
        if self.holds_reproduced is None or self.holds_paper is None:
            return None
        return self.holds_reproduced == self.holds_paper

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "statement": self.statement, "reproduced": self.reproduced,
                "paper": self.paper, "holds_reproduced": self.holds_reproduced, "holds_paper": self.holds_paper,
                "verdict_reproduced": self.verdict_reproduced.value, "verdict_paper": self.verdict_paper.value,
                "reason": self.reason, "device": self.device, "agrees": self.agrees, "extension": self.extension,
                "tests": [t.to_json() | ({"spread": sp.to_json()} if sp else {})
                          for t, sp in zip(self.tests, self.spreads or [None] * len(self.tests), strict=True)],
                **({"verdict_run": self.verdict_run.value} if self.verdict_run is not None else {})}


Outcome = bool | Verdict | None


@dataclass(frozen=True)
class Evaluation:
    """What an evaluator says about one side: the text shown, the outcome and, when unresolved, why."""

    text: str
    outcome: Outcome
    reason: str = ""
    tests: tuple[Test, ...] = ()  # the CI decisions a device outcome rests on


# --------------------------------------------------------------------------------------------- CI decisions


def cell_ci(c: Cell | None) -> CI | None:
    """A reproduced device cell's CI (None for a cell without one: the paper's, an older JSON's, a recall cell)."""
    if c is None or not c.has_ci:
        return None
    assert c.value is not None and c.lo is not None and c.hi is not None
    return CI(c.value, c.lo, c.hi, int(c.n or 0))


def paired_difference(a: Cell, b: Cell) -> CI | None:
    """CI of mean(a - b) over the repeats both cells have, resampling those repeats (``bootstrap_ci``); None when
    either lacks per-repeat values or they share no repeat."""
    if not a.repeats or not b.repeats:
        return None
    common = sorted(set(a.repeats) & set(b.repeats), key=lambda k: (len(k), k))
    if not common:
        return None
    return bootstrap_ci([a.repeats[k] - b.repeats[k] for k in common])


def fmt_ci(ci: CI, dec: int, unit: str, sign: bool = True) -> str:
    f = (lambda v: f"{v:+.{dec}f}") if sign else (lambda v: f"{v:.{dec}f}")
    return f"{f(ci.mean)}{unit} ({_PCT} CI {f(ci.lo)}..{f(ci.hi)}{unit}, n={ci.n})"


def decide_sign(ci: CI, positive: bool = True) -> tuple[Verdict, str]:
    """'> 0' (``positive``) holds iff lo > 0 and fails iff hi < 0; '≤ 0' (not ``positive``) holds iff hi ≤ 0 and
    fails iff lo > 0. Otherwise, or with a single repeat, unresolved with the reason."""
    if not ci.decidable:
        return Verdict.UNRESOLVED, f"{ci.n} repeat: not decidable"
    if positive:
        if ci.lo > 0:
            return Verdict.HOLDS, ""
        if ci.hi < 0:
            return Verdict.FAILS, ""
    else:
        if ci.hi <= 0:
            return Verdict.HOLDS, ""
        if ci.lo > 0:
            return Verdict.FAILS, ""
    return Verdict.UNRESOLVED, f"the {_PCT} CI contains 0"


def decide_within(ci: CI, tol: float) -> tuple[Verdict, str]:
    """'|x| ≤ tol' holds iff the CI lies within ±tol, fails iff it lies entirely outside, else unresolved."""
    if not ci.decidable:
        return Verdict.UNRESOLVED, f"{ci.n} repeat: not decidable"
    if -tol <= ci.lo and ci.hi <= tol:
        return Verdict.HOLDS, ""
    if ci.hi < -tol or ci.lo > tol:
        return Verdict.FAILS, ""
    return Verdict.UNRESOLVED, f"the {_PCT} CI straddles ±{tol:g}"


def combine(verdicts: Sequence[tuple[Verdict, str]]) -> tuple[Verdict, str]:
    """All of several conditions: fails if any fails, holds if all hold, else unresolved (first reason)."""
    if any(v is Verdict.FAILS for v, _ in verdicts):
        return Verdict.FAILS, ""
    if all(v is Verdict.HOLDS for v, _ in verdicts):
        return Verdict.HOLDS, ""
    return Verdict.UNRESOLVED, next(r for v, r in verdicts if v is not Verdict.HOLDS)


_SWAPPED = {Verdict.HOLDS: Verdict.FAILS, Verdict.FAILS: Verdict.HOLDS}
RULES = ("positive", "non_positive", "within")


@dataclass(frozen=True)
class Test:
    """One CI decision a device claim rests on: an effect's CI (a gain, a paired difference, a loss) and what it
    must show: > 0 (``positive``), ≤ 0 (``non_positive``) or within ±``tolerance`` (``within``); ``inverted`` when
    the claim holds where the test fails (``profiled_at_peak``: "the peak is faster than the profiled budget" fails
    it). ``key`` names the effect within its claim (a cell id, a row; "" for a claim's one effect), so the same
    effect can be found in another run's comparison.json and the runs pooled (``render.diff.verdicts_across_runs``)."""

    ci: CI
    rule: str = "positive"
    tolerance: float = 0.0
    inverted: bool = False
    key: str = ""

    def decide(self, ci: CI | None = None) -> tuple[Verdict, str]:
        """The verdict on this test's CI, or on another interval of the same effect (the runs pooled)."""
        ci = self.ci if ci is None else ci
        if self.rule == "within":
            v, why = decide_within(ci, self.tolerance)
        else:
            v, why = decide_sign(ci, positive=self.rule == "positive")
        return (_SWAPPED.get(v, v), why) if self.inverted else (v, why)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "mean": self.ci.mean, "lo": self.ci.lo, "hi": self.ci.hi, "n": self.ci.n,
                "rule": self.rule, "tolerance": self.tolerance, "inverted": self.inverted}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Test:
        """A test as comparison.json keeps it; a malformed one is a ``ValueError`` naming what is wrong."""
        try:
            ci = CI(float(d["mean"]), float(d["lo"]), float(d["hi"]), int(d["n"]))
            test = Test(ci, str(d.get("rule", "positive")), float(d.get("tolerance", 0.0)),
                        bool(d.get("inverted", False)), str(d.get("key", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a test needs mean, lo, hi and n ({exc})") from None
        if test.rule not in RULES:
            raise ValueError(f"unknown rule {test.rule!r} (one of {', '.join(RULES)})")
        return test

    def same_effect(self, other: Test) -> bool:
        """Whether ``other`` (another run's test) tests the same effect the same way: key, rule, tolerance, sense."""
        return (self.key, self.rule, self.tolerance, self.inverted) == (other.key, other.rule, other.tolerance,
                                                                       other.inverted)


_Z975 = 1.959964  # the normal quantile a run's 95 % CI half-width is divided by for its standard error


@dataclass(frozen=True)
class Spread:
    """How far one effect moves between runs (fresh DAGs at other hours) beyond each run's own CI, from ``k`` runs'
    tests of it: ``tau``² = the variance of their means (k - 1 degrees of freedom) minus the mean of their
    squared standard errors (a run's CI half-width / 1.96), at least 0: the method-of-moments estimate of the
    between-study variance of a random-effects model, the hour the random unit. A run's CI of the effect across
    hours (``widen``) adds ``margin`` = t_{0.975, k-1} · tau to each side in quadrature: the run's own hour is one
    draw it cannot see past, and t with k - 1 degrees of freedom pays for estimating tau from k runs (tau = 0, the
    runs agreeing within their own CIs: the run's CI unchanged)."""

    tau: float
    k: int

    @property
    def margin(self) -> float:
        return t_quantile(self.k - 1) * self.tau

    @staticmethod
    def of(tests: Sequence[Test]) -> Spread | None:
        """The spread of the same effect's tests in ``k`` >= 2 runs; None with fewer."""
        if len(tests) < 2:
            return None
        means = [t.ci.mean for t in tests]
        mean = sum(means) / len(means)
        between = sum((m - mean) ** 2 for m in means) / (len(means) - 1)
        within = sum((t.ci.half_width / _Z975) ** 2 for t in tests) / len(tests)
        return Spread(math.sqrt(max(0.0, between - within)), len(tests))

    def widen(self, ci: CI) -> CI:
        m = self.margin
        return CI(ci.mean, ci.mean - math.hypot(ci.mean - ci.lo, m), ci.mean + math.hypot(ci.hi - ci.mean, m), ci.n)

    def to_json(self) -> dict[str, Any]:
        return {"tau": self.tau, "k": self.k, "margin": self.margin}


def judge_across_runs(tests: Sequence[Test],
                      runs: Sequence[Sequence[Test]]) -> tuple[Verdict, str, tuple[Spread | None, ...]]:
    """One run's tests of a claim decided across hours: each test's CI widened by its effect's ``Spread`` over every
    run's tests of the same claim (``runs``: one sequence per run, this one included; a test fewer than two runs
    have is decided by its own CI), combined as the claim's own decisions are. Returns (verdict, reason, the spread
    per test)."""
    spreads = tuple(Spread.of([u for run in runs for u in run if u.same_effect(t)]) for t in tests)
    v, why = combine([t.decide(None if sp is None else sp.widen(t.ci)) for t, sp in zip(tests, spreads, strict=True)])
    if v is Verdict.UNRESOLVED and any(spreads):
        why = why.replace(f"the {_PCT} CI", f"the {_PCT} CI with the spread between runs")
    return v, why, spreads


def across_runs(claim: Claim, kept: Sequence[Mapping[str, Sequence[Test]]]) -> Claim:
    """A device claim judged across hours (``judge_across_runs``): its tests' spread estimated over the kept runs'
    (claim id -> tests, one mapping per kept run) and its own, its own verdict kept as ``verdict_run``; any other
    claim, or one without tests, as is."""
    if not claim.device or not claim.tests or not kept:
        return claim
    v, why, spreads = judge_across_runs(claim.tests, [*(run.get(claim.id, ()) for run in kept), claim.tests])
    return replace(claim, verdict_reproduced=v, reason=why if v is Verdict.UNRESOLVED else "",
                   verdict_run=claim.verdict_reproduced, spreads=spreads)


def greater(a: Cell, b: Cell, dec: int, unit: str,
            key: str = "") -> tuple[Verdict | bool, str, str, Test | None]:
    """a > b: by the paired CI of a - b (per repeat), else by the two CIs (holds iff a.lo > b.hi, fails iff a.hi <
    b.lo), else by the values. Returns (outcome, the difference's text, reason, the paired difference's ``Test``
    named ``key``; None when unpaired)."""
    d = paired_difference(a, b)
    if d is not None:
        test = Test(d, key=key)
        v, why = test.decide()
        return v, f"; Δ {fmt_ci(d, dec, unit)}", why, test
    ca, cb = cell_ci(a), cell_ci(b)
    assert a.value is not None and b.value is not None
    if ca is not None and cb is not None:
        if not (ca.decidable and cb.decidable):
            return Verdict.UNRESOLVED, "", "1 repeat: not decidable", None
        if ca.lo > cb.hi:
            return Verdict.HOLDS, "", "", None
        if ca.hi < cb.lo:
            return Verdict.FAILS, "", "", None
        return Verdict.UNRESOLVED, "", f"the two {_PCT} CIs overlap (unpaired)", None
    return a.value > b.value, "", "", None


@dataclass(frozen=True)
class Stated:
    """The count a count claim states: ``hits`` of ``total`` settings (``hits`` None: all of them), and where it
    comes from (the paper's text, or its table where the text gives no number)."""

    hits: int | None
    total: int
    source: str = "its text"

    def met(self, hits: int, total: int) -> bool:
        """Exactly as stated: all settings for "all N"; at least ``hits`` of the same ``total`` for "n of N" (for
        another profile's number of settings, at least the same share)."""
        if self.hits is None:
            return hits == total
        if total == self.total:
            return hits >= self.hits
        return hits * self.total >= self.hits * total

    def describe(self) -> str:
        return f"all {self.total}" if self.hits is None else f"{self.hits} of {self.total}"


# --------------------------------------------------------------------------------------------- the claims file


def _vocabularies() -> dict[str, tuple[str, Mapping[str, Any]]]:
    """Operand keys whose values are ids of a vocabulary: (what it is, id -> the label the cells carry). Read when a
    file is loaded, so a method or policy registered since (a plugin) is known."""
    return {
        "method": ("predictor method", METHOD_LABELS),
        "policy": ("runtime policy", style.POLICY_LABELS),
        "storage": ("storage", {s: s for s in style.STORAGE_LABELS}),  # table and figure cells carry storage ids
        "mode": ("latency mode", {m: m for m in LATENCY_MODES}),
    }


def _dotted(path: Sequence[Any]) -> str:
    """A key's path as the file spells it: ``cells[0].storage``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# the keys a cell selector matches by, besides ``name`` (the last part of a cell's id)
SELECTOR_KEYS = ("policy", "method", "storage", "mode", "column", "compute_opt", "m_max", "batch", "variant")


@dataclass(frozen=True)
class Selector:
    """Cells by their name (the last part of the id) and keys, the keys' values already the cells' labels."""

    name: str | None
    keys: tuple[tuple[str, Any], ...]

    def matches(self, c: Cell) -> bool:
        """Name and keys; a variant's cells (key ``variant``, device.variants) only when the selector names it, so a
        claim about the default's runs never mixes in another emulation's or I/O order's."""
        want = dict(self.keys).get("variant")
        return ((self.name is None or c.id.rsplit("/", 1)[-1] == self.name) and c.keys.get("variant") == want
                and all(k in c.keys and c.keys[k] == v for k, v in self.keys))


@dataclass(frozen=True)
class ClaimSpec:
    """One entry of the claims file, checked: ``source`` is the table/figure name, ``label`` its printed name, ``ops``
    the kind's operands (selectors resolved, method ids mapped to labels)."""

    id: str
    source: str
    label: str
    statement: str
    kind: str
    device: bool
    optional: bool
    ops: dict[str, Any]
    paper: dict[str, Any] | None = None
    extension: bool = False
    is_table: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_table", self.source in TABLE_NAMES)


@functools.cache
def _schema() -> dict[str, Any]:
    return yaml.safe_load(CLAIMS_SCHEMA.read_text())


def _schema_message(err: Any, raw: Mapping[str, Any], where: str) -> str:
    """One line: the claim (by its id when it has one) and the key jsonschema objects to."""
    path = list(err.absolute_path)
    msg = err.message
    if err.validator in ("unevaluatedProperties", "additionalProperties"):
        extra = re.findall(r"'([^']+)' (?:was|were) unexpected", msg)
        if extra:
            path, msg = [*path, extra[0]], "unknown key" + (" for this kind" if len(path) == 2 else "")
    if err.validator == "required":
        missing = re.findall(r"'([^']+)' is a required property", msg)
        if missing:
            path, msg = [*path, missing[0]], "missing"
    if err.validator == "not" and isinstance(err.validator_value, Mapping) and "required" in err.validator_value:
        path, msg = [*path, err.validator_value["required"][0]], "not allowed here"
    if err.validator in ("oneOf", "anyOf"):
        msg = err.schema.get("description", "does not match any allowed form")
    if len(path) >= 2 and path[0] == "claims" and isinstance(path[1], int):
        entry = (raw.get("claims") or [])[path[1]]
        cid = entry.get("id") if isinstance(entry, Mapping) else None
        who = f"claim {cid!r}" if isinstance(cid, str) else f"claims[{path[1]}]"
        return f"{where}: {who}: key {_dotted(path[2:]) or '<entry>'!r}: {msg}"
    return f"{where}: key {_dotted(path) or '<top level>'!r}: {msg}"


def _validate_schema(raw: Mapping[str, Any], where: str) -> None:
    import jsonschema
    from jsonschema import Draft202012Validator

    errors = list(Draft202012Validator(_schema()).iter_errors(raw))
    # an unknown or missing key of a kind also leaves its other keys unevaluated: report the cause, not that
    primary = [e for e in errors if e.validator != "unevaluatedProperties"] or errors
    if primary:
        raise ClaimsError(_schema_message(jsonschema.exceptions.best_match(primary), raw, where))


def _selector(sel: Mapping[str, Any], who: str, key: str) -> Selector:
    vocab = _vocabularies()
    keys = []
    for k in SELECTOR_KEYS:
        if k not in sel:
            continue
        v = sel[k]
        if k in vocab:
            v = _label(vocab[k], v, who, f"{key}.{k}")
        keys.append((k, v))
    return Selector(sel.get("name"), tuple(keys))


def _label(vocab: tuple[str, Mapping[str, Any]], value: Any, who: str, key: str) -> Any:
    """The label cells carry for an id of a vocabulary; an unknown id (a display label too) is the file's error."""
    what, labels = vocab
    if not isinstance(value, str) or value not in labels:
        raise ClaimsError(f"{who}: key {key!r}: unknown {what} {value!r} (known: {', '.join(labels)})")
    return labels[value]


_SELECTOR_OPS = ("cell", "a", "b", "select", "target")
_METHOD_OPS = ("method", "other")


def _spec(entry: Mapping[str, Any], sources: Mapping[str, str], where: str) -> ClaimSpec:
    who = f"{where}: claim {entry['id']!r}"
    source = entry["source"]
    if source not in sources:
        raise ClaimsError(f"{who}: key 'source': {source!r} is not in 'sources' ({', '.join(sources)})")
    is_table = source in TABLE_NAMES
    if entry["kind"] in ("count", "gain", "param_ratio") and not is_table:
        raise ClaimsError(f"{who}: key 'kind': {entry['kind']!r} reads a recall or parameter table, not {source}")
    extension = bool(entry.get("extension", False))
    if extension and "paper" in entry:
        raise ClaimsError(f"{who}: key 'paper': an extension claim (beyond the paper) has no paper side; drop 'paper'")
    if not extension and is_table == ("paper" in entry):
        raise ClaimsError(f"{who}: key 'paper': " + ("a table claim is evaluated on the paper's own table; drop "
                                                     "'paper'" if is_table else
                                                     "missing (a figure claim quotes the paper's numbers)"))
    if entry.get("paper", {}).get("holds") == "equal" and len(entry["paper"].get("in_text", [])) != 2:
        raise ClaimsError(f"{who}: key 'paper.holds': 'equal' compares exactly two in_text numbers")
    ops: dict[str, Any] = {}
    for k, v in entry.items():
        if k in ("id", "source", "statement", "kind", "device", "optional", "paper", "extension"):
            continue
        if k in _SELECTOR_OPS:
            v = _selector(v, who, k)
        elif k == "cells":
            v = [_selector(s, who, f"cells[{i}]") for i, s in enumerate(v)]
        elif k in _METHOD_OPS:
            v = _label(_vocabularies()["method"], v, who, k)
        elif k == "budget":
            v = str(v)
        elif k == "stated":
            v = Stated(v.get("hits"), v["of"])
        ops[k] = v
    return ClaimSpec(entry["id"], source, sources[source], entry["statement"], entry["kind"],
                     bool(entry.get("device", False)), bool(entry.get("optional", False)), ops, entry.get("paper"),
                     extension)


def parse_claims(raw: Any, where: str = "claims.yaml") -> list[ClaimSpec]:
    """The claims file's mapping, checked against the schema and the vocabularies, as evaluable specs."""
    if not isinstance(raw, Mapping):
        raise ClaimsError(f"{where}: not a claims file (a mapping with format {CLAIMS_FORMAT!r})")
    _validate_schema(raw, where)
    sources = dict(raw["sources"])
    for name in sources:
        if name not in TABLE_NAMES and name not in FIGURE_NAMES:
            raise ClaimsError(f"{where}: key 'sources.{name}': not a table or figure ({', '.join(TABLE_NAMES)}, "
                              f"{', '.join(FIGURE_NAMES)})")
    specs, seen = [], set()
    for entry in raw["claims"]:
        if entry["id"] in seen:
            raise ClaimsError(f"{where}: claim {entry['id']!r}: key 'id': duplicate")
        seen.add(entry["id"])
        specs.append(_spec(entry, sources, where))
    return specs


def load_claims(path: str | Path | None = None) -> list[ClaimSpec]:
    """Read and check the claims file (default ``config/reference/claims.yaml``)."""
    path = Path(path or DEFAULT_CLAIMS)
    try:
        raw = read_doc(path, CLAIMS_FORMAT, "claims file", kind="yaml")
    except ContractError as exc:
        raise ClaimsError(str(exc)) from None
    return parse_claims(raw, str(path))


# --------------------------------------------------------------------------------------------- cells


def _select_one(doc: TableDoc, sel: Selector, spec: ClaimSpec, key: str) -> Cell | None:
    found = [c for c in doc.cells if sel.matches(c)]
    if len(found) > 1:
        raise ClaimsError(f"claim {spec.id!r}: key {key!r} matches {len(found)} cells of {doc.name} "
                          f"({', '.join(c.id for c in found[:3])}); name one")
    return found[0] if found else None


def _item(fmt: str, c: Cell, spec: ClaimSpec) -> str:
    try:
        return fmt.format_map({**c.keys, "value": c.value})
    except (KeyError, IndexError, ValueError) as exc:
        raise ClaimsError(f"claim {spec.id!r}: key 'item': {fmt!r} does not fit cell {c.id} ({exc!r})") from None


def _sweep(doc: TableDoc, spec: ClaimSpec) -> list[Cell]:
    """The selected cells with a value, in sweep order: by the ``over`` key's value, or for storages fastest to
    slowest (``render.style.STORAGE_ORDER``; a storage outside it has no place on the axis and is left out)."""
    over = spec.ops["over"]
    cells = [c for c in doc.cells if spec.ops["select"].matches(c) and c.value is not None and over in c.keys]
    if over == "storage":
        order = list(style.STORAGE_ORDER)
        return sorted((c for c in cells if c.keys["storage"] in order), key=lambda c: order.index(c.keys["storage"]))
    return sorted(cells, key=lambda c: c.keys[over])


def _present(spec: ClaimSpec, doc: TableDoc) -> bool:
    """Whether the reproduced figure has what an ``optional`` claim is about."""
    if spec.kind == "sign" and "cells" in spec.ops:
        return all((c := _select_one(doc, s, spec, "cells")) is not None and c.value is not None
                   for s in spec.ops["cells"])
    if "over" in spec.ops:
        return bool(_sweep(doc, spec))
    if "select" not in spec.ops:  # two cells (greater, within): both present
        keys = [k for k in ("a", "b", "cell") if k in spec.ops]
        return all((c := _select_one(doc, spec.ops[k], spec, k)) is not None and c.value is not None for k in keys)
    return any(spec.ops["select"].matches(c) and c.value is not None for c in doc.cells)


# --------------------------------------------------------------------------------------------- kinds: recall tables


def _need_keys(doc: TableDoc, spec: ClaimSpec, keys: Sequence[str]) -> None:
    """A recall or parameter kind on a table whose cells lack its keys: the claims file's error, named."""
    for c in doc.cells:
        missing = [k for k in keys if k not in c.keys]
        if missing:
            raise ClaimsError(f"claim {spec.id!r}: key 'kind': {spec.kind!r} needs cells keyed by {', '.join(keys)}; "
                              f"{doc.name}'s cell {c.id} has no {missing[0]!r}")


def _setting_cells(doc: TableDoc, method: str) -> dict[tuple[str, str, str], dict[str, Cell]]:
    """(model, workload, budget) -> {method label: cell} for recall tables, only settings where ``method`` has a
    value. A row beyond the paper (key ``extension``) is no rival in the paper's claims."""
    out: dict[tuple[str, str, str], dict[str, Cell]] = {}
    for c in doc.cells:
        if c.value is not None and not c.keys.get("extension"):
            out.setdefault((c.keys["model"], c.keys["workload"], str(c.keys["budget"])), {})[c.keys["method"]] = c
    return {k: v for k, v in out.items() if method in v}


def seed_difference(a: Cell, b: Cell) -> CI | None:
    """The 95 % t-interval of a - b over training seeds, paired by seed index (a cell without per-seed values, a
    training-free method's, pairs its one value with each of the other's seeds); None when neither has per-seed
    values or they share no seed."""
    if not a.repeats and not b.repeats:
        return None
    assert a.value is not None and b.value is not None
    ra = a.repeats or {}
    rb = b.repeats or {}
    seeds = sorted(set(ra) & set(rb)) if ra and rb else sorted(ra or rb)
    if not seeds:
        return None
    return seed_ci([ra.get(k, a.value) - rb.get(k, b.value) for k in seeds])


SettingOutcome = str  # "yes" (the test holds), "no" (it fails), "tie" (undecided by the seeds' CI)


def _beats(a: Cell, b: Cell) -> SettingOutcome:
    """a beats b: by the paired seed interval when there is one (yes iff lo > 0, no iff hi < 0, else tie), else by
    the values at the printed precision (yes iff greater)."""
    d = seed_difference(a, b)
    if d is not None and d.decidable:
        return "yes" if d.lo > 0 else "no" if d.hi < 0 else "tie"
    assert a.value is not None and b.value is not None
    return "yes" if round(a.value, 2) > round(b.value, 2) else "no"


def _setting_outcome(spec: ClaimSpec, cells: Mapping[str, Cell]) -> SettingOutcome | None:
    """``beats``: the method against ``other`` (None where the other has no value); ``best_or_tied``: no where
    another method beats it, yes where its value is the best (ties at the printed precision included), tie where
    it is below another's value but no other beats it by the seeds' interval."""
    m = spec.ops["method"]
    if spec.ops["test"] == "beats":
        other = spec.ops["other"]
        return None if other not in cells else _beats(cells[m], cells[other])
    rivals = [c for label, c in cells.items() if label != m]
    if any(_beats(c, cells[m]) == "yes" for c in rivals):
        return "no"
    assert cells[m].value is not None
    best = max(round(c.value, 2) for c in cells.values() if c.value is not None)
    return "yes" if round(cells[m].value, 2) >= best else "tie"


def _settings(doc: TableDoc, method: str) -> dict[tuple[str, str, str], dict[str, float]]:
    """(model, workload, budget) -> {method label: value} for recall tables, only settings where ``method`` has one
    (rows beyond the paper left out, as in :func:`_setting_cells`)."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for c in doc.cells:
        if c.value is not None and not c.keys.get("extension"):
            out.setdefault((c.keys["model"], c.keys["workload"], str(c.keys["budget"])), {})[c.keys["method"]] = \
                round(c.value, 2)
    return {k: v for k, v in out.items() if method in v}


def tally_ties(doc: TableDoc, spec: ClaimSpec) -> tuple[int, int, int]:
    """(settings where the test holds, settings tied by the seeds' interval, settings where it applies), at
    ``budget`` when given."""
    _need_keys(doc, spec, ("model", "workload", "method", "budget"))
    budget = spec.ops.get("budget")
    hits = ties = total = 0
    for (_, _, b), cells in _setting_cells(doc, spec.ops["method"]).items():
        if budget is not None and b != budget:
            continue
        res = _setting_outcome(spec, cells)
        if res is None:
            continue
        total += 1
        hits += res == "yes"
        ties += res == "tie"
    return hits, ties, total


def tally(doc: TableDoc, spec: ClaimSpec) -> tuple[int, int]:
    """(settings where the test holds, settings where it applies), at ``budget`` when given."""
    hits, _, total = tally_ties(doc, spec)
    return hits, total


def _count(spec: ClaimSpec, doc: TableDoc | None, stated: Stated | None) -> Evaluation:
    """"n of N" settings where the test holds; the claim holds only as ``stated`` (no stated count: n/a). With
    settings tied by the seeds' interval: holds when the decided settings alone meet the count, fails when not even
    every tie counted for it would, unresolved in between."""
    if doc is None:
        return Evaluation("not rendered", None)
    hits, ties, total = tally_ties(doc, spec)
    if total == 0:
        return Evaluation("no settings", None)
    text = f"{hits} of {total}" + (f" ({ties} tied within the seeds' {_PCT} CI)" if ties else "")
    if stated is None:
        return Evaluation(text, None)
    if stated.met(hits, total):
        return Evaluation(text, True)
    if ties and stated.met(hits + ties, total):
        return Evaluation(text, Verdict.UNRESOLVED, f"depends on {ties} setting(s) tied within the seeds' {_PCT} "
                                                    "CI of the paired difference")
    return Evaluation(text, False)


def _gain(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """Per model, the method's largest (or mean) gain over ``other`` across settings (at ``budget``); all > 0."""
    if doc is None:
        return Evaluation("not rendered", None)
    _need_keys(doc, spec, ("model", "workload", "method", "budget"))
    m, other, budget = spec.ops["method"], spec.ops["other"], spec.ops.get("budget")
    gains: dict[str, list[tuple[float, str]]] = {}
    for (model, workload, b), v in _settings(doc, m).items():
        if other in v and (budget is None or b == budget):
            gains.setdefault(model, []).append((v[m] - v[other], f"{workload} R@{b}"))
    if not gains:
        return Evaluation("no settings", None)
    if spec.ops["aggregate"] == "largest":
        best = {model: max(g, key=lambda x: x[0]) for model, g in gains.items()}  # the first of equal gains
        parts = [f"{model}: {g:+.2f} pp ({where})" for model, (g, where) in best.items()]
        values = [g for g, _ in best.values()]
    else:
        means = {model: sum(x for x, _ in g) / len(g) for model, g in gains.items()}
        parts = [f"{model}: {g:+.2f} pp" for model, g in means.items()]
        values = list(means.values())
    return Evaluation("; ".join(parts), all(g > 0 for g in values))


def _param_ratio(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The method's parameters as % of ``other``'s per model; below ``below`` for every model (else n/a)."""
    if doc is None:
        return Evaluation("not rendered", None)
    _need_keys(doc, spec, ("model", "method"))
    m, other, below = spec.ops["method"], spec.ops["other"], spec.ops.get("below")
    vals: dict[str, dict[str, float]] = {}
    for c in doc.cells:
        if c.value is not None:
            vals.setdefault(c.keys["model"], {})[c.keys["method"]] = c.value
    parts, holds = [], True
    for model, v in vals.items():
        if m in v and v.get(other):
            ratio = 100.0 * v[m] / v[other]
            parts.append(f"{model}: {ratio:.1f}%")
            holds &= below is None or ratio < below
    if not parts:
        return Evaluation("no settings", None)
    return Evaluation("; ".join(parts), holds if below is not None else None)


# --------------------------------------------------------------------------------------------- kinds: cells


def _sign(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """Every cell > 0 (``positive``) or ≤ 0 (``non_positive``): the listed ``cells``, or every ``select``ed cell with
    a value (e.g. one per storage and batch size, each shown with ``item``'s keys); by their CIs when all have one,
    else the values."""
    if doc is None:
        return Evaluation("not rendered", None)
    if "cells" in spec.ops:
        cs = [_select_one(doc, s, spec, f"cells[{i}]") for i, s in enumerate(spec.ops["cells"])]
        if any(c is None or c.value is None for c in cs):
            return Evaluation("no value", None)
        cells = [c for c in cs if c is not None]
    else:
        cells = [c for c in doc.cells if spec.ops["select"].matches(c) and c.value is not None]
        if not cells:
            return Evaluation("no value", None)
    positive = spec.ops["direction"] == "positive"
    cis = [cell_ci(c) for c in cells]

    def shown(c: Cell, text: str) -> str:
        return f"{_item(spec.ops['item'], c, spec)} {text}" if "item" in spec.ops else text

    if any(ci is None for ci in cis):
        values = [float(c.value or 0.0) for c in cells]
        return Evaluation(", ".join(shown(c, f"{v:+.2f}%") for c, v in zip(cells, values, strict=True)),
                          all(v > 0 for v in values) if positive else all(v <= 0 for v in values))
    decided = [ci for ci in cis if ci is not None]
    rule = "positive" if positive else "non_positive"
    tests = tuple(Test(ci, rule, key=c.id) for c, ci in zip(cells, decided, strict=True))
    v, why = combine([t.decide() for t in tests])
    return Evaluation(", ".join(shown(c, fmt_ci(ci, 2, "%")) for c, ci in zip(cells, decided, strict=True)), v, why,
                      tests)


def _within(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """'|value| ≤ tolerance' of one cell (``cell``), or of every selected cell (``select``, e.g. one per storage,
    each shown with ``item``'s keys): by each CI (``decide_within``), else by the value; several cells hold only
    when all do (``combine``)."""
    if doc is None:
        return Evaluation("not rendered", None)
    if "cell" in spec.ops:
        c = _select_one(doc, spec.ops["cell"], spec, "cell")
        cells = [] if c is None or c.value is None else [c]
    else:
        cells = [c for c in doc.cells if spec.ops["select"].matches(c) and c.value is not None]
    if not cells:
        return Evaluation("no value", None)
    tol = float(spec.ops["tolerance"])
    texts, verdicts, tests = [], [], []
    for c in cells:
        ci = cell_ci(c)
        if ci is None:
            text, verdict = f"{c.value:+.2f}%", (Verdict.of(abs(c.value) <= tol), "")
        else:
            tests.append(Test(ci, "within", tol, key=c.id))
            text, verdict = fmt_ci(ci, 2, "%"), tests[-1].decide()
        texts.append(f"{_item(spec.ops['item'], c, spec)} {text}" if "item" in spec.ops else text)
        verdicts.append(verdict)
    v, why = combine(verdicts)
    return Evaluation("; ".join(texts), v, why, tuple(tests))


def _greater(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """'a > b' of two cells: by the paired CI of their per-repeat difference (``greater``)."""
    ca = None if doc is None else _select_one(doc, spec.ops["a"], spec, "a")
    cb = None if doc is None else _select_one(doc, spec.ops["b"], spec, "b")
    if ca is None or cb is None or ca.value is None or cb.value is None:
        return Evaluation("not rendered" if doc is None else "no value", None)
    dec, unit = spec.ops.get("decimals", 2), spec.ops.get("unit", "%")
    outcome, diff, why, test = greater(ca, cb, dec, unit)
    return Evaluation(f"{ca.value:.{dec}f}{unit} vs {cb.value:.{dec}f}{unit}" + diff, outcome, why, _tests(test))


def _tests(test: Test | None) -> tuple[Test, ...]:
    return () if test is None else (test,)


# --------------------------------------------------------------------------------------------- kinds: figures


def _values(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The selected values listed; each above ``above`` (no ``above``: informational)."""
    cells = [] if doc is None else [c for c in doc.cells if spec.ops["select"].matches(c) and c.value is not None]
    if not cells:
        return Evaluation("not rendered" if doc is None else "no value", None)
    above = spec.ops.get("above")
    return Evaluation("; ".join(_item(spec.ops["item"], c, spec) for c in cells),
                      None if above is None else all(float(c.value or 0.0) > above for c in cells))


def _monotone(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """Within each ``group_by`` group the values never decrease along the sweep key ``over``."""
    if doc is None:
        return Evaluation("not rendered", None)
    over, by = spec.ops["over"], spec.ops["group_by"]
    cells = [c for c in doc.cells if spec.ops["select"].matches(c) and c.value is not None and over in c.keys
             and all(g in c.keys for g in by)]

    def group(c: Cell) -> str:
        return "/".join(str(c.keys[g]) for g in by)

    groups: dict[str, list[Cell]] = {}
    for c in sorted(cells, key=lambda c: (group(c), c.keys[over])):
        groups.setdefault(group(c), []).append(c)
    if not groups:
        return Evaluation("no value", None)
    text = "; ".join(", ".join(_item(spec.ops["item"], c, spec) for c in cs) for cs in groups.values())
    return Evaluation(text, all(float(a.value or 0.0) <= float(b.value or 0.0)
                                for cs in groups.values() for a, b in zip(cs, cs[1:], strict=False)))


def _rises(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The sweep's last value > its first, paired per repeat; shown as its two ends or every value."""
    sw = [] if doc is None else _sweep(doc, spec)
    if not sw:
        return Evaluation("not rendered" if doc is None else "no value", None)
    first, last = sw[0], sw[-1]
    item = spec.ops["item"]
    if spec.ops["show"] == "ends":
        text = f"{_item(item, first, spec)} → {_item(item, last, spec)}"
    else:
        text = ", ".join(_item(item, c, spec) for c in sw)
    outcome, diff, why, test = greater(last, first, spec.ops.get("decimals", 2), spec.ops.get("unit", "%"))
    return Evaluation(text + diff, outcome, why, _tests(test))


def _peak_below_end(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The sweep peaks below its largest setting: the best bounded setting vs the largest, paired per repeat."""
    tp = [] if doc is None else _sweep(doc, spec)
    if not tp:
        return Evaluation("not rendered" if doc is None else "no value", None)
    over, label = spec.ops["over"], spec.ops["label"]
    peak = max(tp, key=lambda c: float(c.value or 0.0))
    text = f"peak at {peak.keys[over]} of {tp[0].keys[over]}–{tp[-1].keys[over]}"
    if len(tp) < 2:
        return Evaluation(text, None)
    best = max(tp[:-1], key=lambda c: float(c.value or 0.0))
    outcome, diff, why, test = greater(best, tp[-1], spec.ops.get("decimals", 2), spec.ops.get("unit", "%"))
    return Evaluation(text + (f" ({label} {best.keys[over]} vs {tp[-1].keys[over]}{diff})" if diff else ""),
                      outcome, why, _tests(test))


def _profiled_at_peak(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The setting the figure's ``meta`` names (the profiled budget) is the sweep's fastest: holds when it is the
    peak, fails when the peak is faster by the paired CI of their difference, unresolved when that CI contains 0."""
    tp = [] if doc is None else _sweep(doc, spec)
    if doc is None or not tp:
        return Evaluation("not rendered" if doc is None else "no value", None)
    over, label = spec.ops["over"], spec.ops["label"]
    peak = max(tp, key=lambda c: float(c.value or 0.0))
    profiled = doc.meta.get(spec.ops["meta"])
    at = next((c for c in tp if c.keys[over] == profiled), None)
    if at is None:
        return Evaluation(f"the profiled {label} was not swept" if profiled is not None else f"no profiled {label}",
                          None)
    text = f"profiled {profiled}, peak at {peak.keys[over]}"
    if at is peak:  # exactly: the effect (the peak's lead) is 0 in every repeat, a value to pool with other runs'
        return Evaluation(text, True, "", (Test(CI(0.0, 0.0, 0.0, int(at.n or 0)), inverted=True),))
    outcome, diff, why, test = greater(peak, at, spec.ops.get("decimals", 2), spec.ops.get("unit", "%"))
    v = Verdict.of(outcome)  # the peak faster than the profiled setting: the claim fails
    tests = () if test is None else (Test(test.ci, inverted=True),)
    return Evaluation(text + diff, _SWAPPED.get(v, v), why, tests)


def _fastest(spec: ClaimSpec, doc: TableDoc | None) -> Evaluation:
    """The ``target`` cell is above every other selected cell (each paired per repeat); the text names the fastest
    configuration by its row (the first part of its cell id)."""
    rows = {} if doc is None else {c.id.split("/")[0]: c for c in doc.cells
                                   if spec.ops["select"].matches(c) and c.value is not None}
    if not rows:
        return Evaluation("not rendered" if doc is None else "no value", None)
    best = max(rows, key=lambda k: float(rows[k].value or 0.0))
    text = f"fastest: {best}"
    target = next((k for k, c in rows.items() if spec.ops["target"].matches(c)), None)
    if target is None:
        return Evaluation(text, None)
    dec, unit = spec.ops.get("decimals", 2), spec.ops.get("unit", "%")
    parts = [greater(rows[target], c, dec, unit, key=k) for k, c in rows.items() if k != target]
    v, why = combine([(Verdict.of(o), r) for o, _, r, _ in parts])
    return Evaluation(text, v, why, tuple(t for *_, t in parts if t is not None))


KINDS: dict[str, Callable[[ClaimSpec, TableDoc | None], Evaluation]] = {
    "gain": _gain, "param_ratio": _param_ratio, "sign": _sign, "within": _within, "greater": _greater,
    "values": _values, "monotone": _monotone, "rises": _rises, "peak_below_end": _peak_below_end,
    "profiled_at_peak": _profiled_at_peak, "fastest": _fastest,
}  # and "count", which also takes the paper's stated count (``evaluate_claim``)


# --------------------------------------------------------------------------------------------- evaluation


def _in_text(rep: Reported, ids: Sequence[str], fmt: str) -> str:
    vals = []
    for i in ids:
        it = rep.in_text[i]
        vals.append(f"≈{it.value:g}" if it.approx else f"{it.value:g}")
    return fmt.format(*vals)


def _paper_side(spec: ClaimSpec, rep: Reported) -> tuple[str, bool | None]:
    """A figure claim's paper column: its quoted in-text numbers (or text) and whether the claim holds there."""
    p = spec.paper or {}
    ids = p.get("in_text", [])
    text = p["text"] if "text" in p else _in_text(rep, ids, p["format"])
    holds = p["holds"]
    if holds == "equal":
        return text, rep.in_text[ids[0]].value == rep.in_text[ids[1]].value
    return text, holds


def check_in_text(specs: Sequence[ClaimSpec], rep: Reported) -> None:
    """Every in-text number a figure claim quotes is in the reported numbers."""
    for s in specs:
        for i in (s.paper or {}).get("in_text", []):
            if i not in rep.in_text:
                raise ClaimsError(f"claim {s.id!r}: key 'paper.in_text': {i!r} is not an in_text id of the reported "
                                  "numbers (paper_reported.yaml)")


def evaluate_claim(spec: ClaimSpec, doc: TableDoc | None, rep: Reported) -> Claim:
    """One claim: a table claim by the same function on the reproduced and on the paper's table; a figure claim on
    the reproduced figure, against the numbers the paper states."""
    statement = spec.statement
    if spec.is_table:
        paper_doc = rep.tables.get(spec.source)
        if spec.kind == "count":
            stated = spec.ops.get("stated")
            if stated is None and paper_doc is not None:  # no count in the text: the paper's own table's
                h, n = tally(paper_doc, spec)
                stated = Stated(h, n, "its table") if n else None
            if stated is not None:
                rule = "only in every setting" if stated.hits is None else "with at least as many"
                statement += f" (the paper: {stated.describe()} settings, in {stated.source}; holds {rule})"
            r, q = _count(spec, doc, stated), _count(spec, paper_doc, stated)
        else:
            r, q = KINDS[spec.kind](spec, doc), KINDS[spec.kind](spec, paper_doc)
        paper_text, paper_outcome = q.text, q.outcome
    else:
        r = KINDS[spec.kind](spec, doc)
        paper_text, paper_outcome = ("– (beyond the paper)", None) if spec.extension else _paper_side(spec, rep)
    return Claim(spec.id, spec.label, statement, r.text, paper_text, Verdict.of(r.outcome), Verdict.of(paper_outcome),
                 r.reason, spec.device, spec.source, spec.extension, r.tests if spec.device else ())


def evaluate_claims(docs: Mapping[str, TableDoc], figs: Mapping[str, TableDoc], rep: Reported,
                    specs: Sequence[ClaimSpec] | None = None) -> list[Claim]:
    """Every claim of the claims file (default ``config/reference/claims.yaml``) in its order: a table claim always
    (a table not rendered says so), a figure claim when its figure was rendered (an ``optional`` one when the
    figure has what it is about)."""
    specs = load_claims() if specs is None else specs
    check_in_text(specs, rep)
    out = []
    for s in specs:
        if s.is_table:
            out.append(evaluate_claim(s, docs.get(s.source), rep))
            continue
        fig = figs.get(s.source)
        if fig is None or (s.optional and not _present(s, fig)):
            continue
        out.append(evaluate_claim(s, fig, rep))
    return out
