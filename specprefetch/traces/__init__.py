"""Routing traces: capture router inputs / logits / executed experts and store them as verified shards.

``store``: :class:`TraceWriter`, :class:`TraceReader`, :class:`TraceError`, :func:`trace_stats` (no model needed).
``extract``: :func:`extract_traces` (one captured forward per sample), :func:`route_captured`.
"""

from specprefetch._lazy import lazy_exports

_EXPORTS = {
    "TraceError": "specprefetch.traces.store",
    "TraceReader": "specprefetch.traces.store",
    "TraceWriter": "specprefetch.traces.store",
    "trace_stats": "specprefetch.traces.store",
}


__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
