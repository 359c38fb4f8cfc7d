"""Routing traces: capture router inputs / logits / executed experts and store them as verified shards.

``store``: :class:`TraceWriter`, :class:`TraceReader`, :class:`TraceError`, :func:`trace_stats` (no model needed).
``extract``: :func:`extract_traces` (one captured forward per sample), :func:`route_captured`.
"""

from specprefetch.traces.store import TraceError, TraceReader, TraceWriter, trace_stats

__all__ = ["TraceError", "TraceReader", "TraceWriter", "trace_stats"]
