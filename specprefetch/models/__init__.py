"""Model zoo: tiny MoE stand-ins, loading real checkpoints, router discovery and capture.

Public API (see the shared data contract): :func:`load_bundle`, :func:`encode_sample`, :func:`discover_routing`,
:class:`ModelBundle`, :class:`RoutingSpec`, :class:`EncodedSample`; capture lives in
:mod:`specprefetch.models.capture` (``RouterCapture``).
"""

# Exports are resolved on first use (PEP 562) so `specprefetch --help` and light subcommands don't import torch.
_EXPORTS = {
    "EncodedSample": "specprefetch.models.loading",
    "ModelBundle": "specprefetch.models.loading",
    "collate_encoded": "specprefetch.models.loading",
    "encode_sample": "specprefetch.models.loading",
    "load_bundle": "specprefetch.models.loading",
    "SUPPORTED_ARCHS": "specprefetch.models.routing",
    "RoutingSpec": "specprefetch.models.routing",
    "discover_routing": "specprefetch.models.routing",
    "select_experts": "specprefetch.models.routing",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
