"""Model zoo: tiny MoE stand-ins, loading real checkpoints, router discovery and capture.

Public API (see the shared data contract): :func:`load_bundle`, :func:`encode_sample`, :func:`discover_routing`,
:class:`ModelBundle`, :class:`RoutingSpec`, :class:`EncodedSample`; capture lives in
:mod:`specprefetch.models.capture` (``RouterCapture``).
"""

from specprefetch._lazy import lazy_exports

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


__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
