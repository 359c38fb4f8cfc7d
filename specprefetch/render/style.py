"""One place for every visual convention: method/policy colours and labels, storage names, figure size and fonts.

Every table and figure takes its colours and names from here (and this from ``specprefetch.registry``), so a method
has the same colour in Figures 1-6 and the per-layer recall figure, renaming a label changes it everywhere at once,
and a name without a colour or label is an error, not a grey bar.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specprefetch import registry
from specprefetch.registry import NameView, TableView

# Colours and labels of methods, policies and storages are the registry's (one place for each name, plugins
# included); these are live views of it. Okabe-Ito (colour-blind safe) plus greys. PALETTE's keys are both predictor
# method names (recall.csv) and runtime policy names (runs.csv); a predictor and the runtime policy that uses it share
# a colour.
PALETTE: Mapping[str, str] = TableView(
    lambda: {**{n: m.color for n, m in registry.methods().items()},
             **{p: registry.policy_color(p) for p in registry.policies()}}, "method or policy")
POLICY_LABELS: Mapping[str, str] = TableView(lambda: {p: registry.policy_label(p) for p in registry.policies()},
                                             "runtime policy")
# LaTeX forms where the paper typesets them differently from plain text.
POLICY_LATEX: Mapping[str, str] = TableView(
    lambda: {p: pol.latex or registry.policy_label(p) for p, pol in registry.policies().items()}, "runtime policy")
POLICY_ORDER: Sequence[str] = NameView(registry.policy_order, "runtime policy")
METHOD_ORDER: Sequence[str] = NameView(registry.methods, "predictor method")

# Fastest to slowest: the order of Figure 5's x axis.
STORAGE_LABELS: Mapping[str, str] = TableView(
    lambda: {s: registry.storage(s).label for s in registry.storage_order()}, "storage")
STORAGE_ORDER: Sequence[str] = NameView(registry.storage_order, "storage")

LATENCY_COMPONENTS: dict[str, tuple[str, str]] = {  # component -> (label, colour), bottom of the stack first
    "attention": ("Attention", "#0072B2"),
    "router": ("Router", "#56B4E9"),
    "moe_compute": ("MoE compute", "#009E73"),
    "expert_load": ("Expert load (exposed)", "#D55E00"),
    "other": ("Other", "#BDBDBD"),
}
MODE_LABELS = {"resident": "Resident", "on_demand": "On-demand"}

COLUMN_WIDTH_IN = 3.3  # one column of a two-column paper
TEXT_WIDTH_IN = 7.0


def method_label(method: str) -> str:
    """Display name of a predictor method or runtime policy; a name the registry lacks is one line."""
    if method in registry.methods():
        return registry.method(method).label
    if method in registry.policies():
        return registry.policy_label(method)
    raise registry.UnknownName(f"no label for {method!r}: not a predictor method ({', '.join(registry.methods())}) "
                               f"nor a runtime policy ({', '.join(registry.policies())})")


def color(name: str) -> str:
    """The colour of a method or policy; a name the registry lacks is one line (never a silent grey)."""
    return PALETTE[name]


def storage_label(storage: str) -> str:
    return STORAGE_LABELS[storage]


def paper_rc() -> dict[str, Any]:
    """Matplotlib settings for figures read at column width: 8 pt text, thin lines, embedded TrueType fonts."""
    return {
        "font.size": 8,
        "axes.titlesize": 8,
        "axes.labelsize": 8,
        "xtick.labelsize": 7,
        "ytick.labelsize": 7,
        "legend.fontsize": 6.5,
        "legend.title_fontsize": 7,
        "axes.linewidth": 0.6,
        "grid.linewidth": 0.4,
        "lines.linewidth": 1.2,
        "lines.markersize": 3.5,
        "errorbar.capsize": 2,
        "pdf.fonttype": 42,
        "ps.fonttype": 42,
        "savefig.bbox": "tight",
        "savefig.pad_inches": 0.02,
        "figure.dpi": 150,
        "svg.hashsalt": "specprefetch",
    }
