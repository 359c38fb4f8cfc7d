"""Routing traces: capture router inputs / logits / executed experts and store them as verified shards.

``store``: :class:`TraceWriter`, :class:`TraceReader`, :class:`TraceError`, :func:`trace_stats` (no model needed).
``extract``: :func:`extract_traces` (one captured forward per sample), :func:`route_captured`.
"""

# Exports are resolved on first use (PEP 562) so `specprefetch --help` and light subcommands don't import torch.
_EXPORTS = {
    "TraceError": "specprefetch.traces.store",
    "TraceReader": "specprefetch.traces.store",
    "TraceWriter": "specprefetch.traces.store",
    "trace_stats": "specprefetch.traces.store",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
