"""Model zoo: tiny MoE stand-ins, loading real checkpoints, router discovery and capture.

Public API (see the shared data contract): :func:`load_bundle`, :func:`encode_sample`, :func:`discover_routing`,
:class:`ModelBundle`, :class:`RoutingSpec`, :class:`EncodedSample`; capture lives in
:mod:`specprefetch.models.capture` (``RouterCapture``).
"""

from specprefetch.models.loading import EncodedSample, ModelBundle, collate_encoded, encode_sample, load_bundle
from specprefetch.models.routing import SUPPORTED_ARCHS, RoutingSpec, discover_routing, select_experts

__all__ = [
    "SUPPORTED_ARCHS",
    "EncodedSample",
    "ModelBundle",
    "RoutingSpec",
    "collate_encoded",
    "discover_routing",
    "encode_sample",
    "load_bundle",
    "select_experts",
]
