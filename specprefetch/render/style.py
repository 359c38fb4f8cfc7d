"""One place for every visual convention: method/policy colours and labels, storage names, figure size and fonts.

Every table and figure takes its colours and names from here, so a method has the same colour in Figures 1-6 and
the per-layer recall figure, and renaming a label changes it everywhere at once.
"""

from __future__ import annotations

from typing import Any

from specprefetch.config import METHOD_LABELS

# Okabe-Ito (colour-blind safe) plus greys. Keys are both predictor method names (recall.csv) and runtime policy
# names (runs.csv); a predictor and the runtime policy that uses it share a colour.
PALETTE: dict[str, str] = {
    "specprefetch": "#D55E00",  # vermillion: the paper's method stands out everywhere
    "fate": "#0072B2",  # blue
    "promoe": "#009E73",  # bluish green
    "draft_model": "#E69F00",  # orange
    "single_mlp": "#56B4E9",  # sky blue
    "previous_token": "#CC79A7",  # reddish purple
    "naive": "#CC79A7",  # Naive Prefetch = the previous token's experts
    "frequency": "#8C6D31",  # brown
    "oracle": "#000000",  # black
    "off": "#7F7F7F",  # grey
    "pred0": "#BDBDBD",  # light grey
    "resident": "#3B3B3B",  # dark grey
}

POLICY_LABELS: dict[str, str] = {
    "off": "OFF",
    "pred0": "PRED0",
    "specprefetch": "SpecPrefetch",
    "naive": "Naive Prefetch",
    "fate": "FATE",
    "resident": "All resident",
}
# LaTeX forms where the paper typesets them differently from plain text.
POLICY_LATEX: dict[str, str] = {**POLICY_LABELS, "pred0": r"PRED$_0$"}
POLICY_ORDER = ["off", "pred0", "naive", "fate", "specprefetch", "resident"]
METHOD_ORDER = list(METHOD_LABELS)

# Fastest to slowest: the order of Figure 5's x axis.
STORAGE_LABELS: dict[str, str] = {
    "ram": "RAM",
    "nvme": "NVMe",
    "nvme_cold": "NVMe (cold)",
    "ufs": "UFS",
    "slow_ufs": "Slow UFS",
    "sdcard": "SD card",
}
STORAGE_ORDER = list(STORAGE_LABELS)

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
    """Display name of a predictor method or runtime policy (falls back to the raw name, never fails)."""
    return METHOD_LABELS.get(method) or POLICY_LABELS.get(method) or method


def color(name: str) -> str:
    """The colour of a method or policy; unknown names get a neutral grey rather than a random colour."""
    return PALETTE.get(name, "#999999")


def storage_label(storage: str) -> str:
    return STORAGE_LABELS.get(storage, storage)


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
