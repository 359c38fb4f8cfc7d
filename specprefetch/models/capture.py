"""Capture router inputs with forward pre-hooks on the gates discovered by :func:`discover_routing`.

A pre-hook only reads the gate's input (a detach, no copy), so the forward's outputs are bit-identical
with and without capture. Logits are recomputed from the gate weight (``RoutingSpec.logits``) rather than
parsed from the gate's output, whose format differs by model and transformers version. Casting and moving
to CPU happen lazily in :meth:`RouterCapture.inputs`, off the forward's critical path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from specprefetch.io import SpecPrefetchError
from specprefetch.models.routing import RoutingSpec


class RouterCapture:
    """Context manager: ``with RouterCapture(model, spec) as cap: model(**kw); xs = cap.inputs()``.

    Every forward inside the block appends one chunk per MoE layer (so decoding step by step accumulates
    tokens in order); :meth:`inputs` concatenates them to ``[tokens, D]`` per layer. :meth:`clear` drops what
    was captured. ``to_cpu``/``dtype`` are applied when :meth:`inputs` is called, not in the hook.
    """

    def __init__(self, model: nn.Module, spec: RoutingSpec, *, to_cpu: bool = False,
                 dtype: torch.dtype | None = None, pre_attention: bool = False) -> None:
        self.model = model
        self.spec = spec
        self.to_cpu = to_cpu
        self.dtype = dtype
        self._chunks: list[list[Tensor]] = [[] for _ in spec.gates]
        # with ``pre_attention``: each MoE layer's pre-attention norm output too (``spec.pre_norms``, forward hooks)
        if pre_attention and len(spec.pre_norms) != len(spec.gates):
            raise SpecPrefetchError(f"{spec.arch}: the routing spec names no pre-attention norm per MoE layer; "
                                    "cannot capture pre-attention inputs")
        self._pre: list[list[Tensor]] | None = [[] for _ in spec.gates] if pre_attention else None
        self._handles: list[RemovableHandle] = []

    # -- hooks
    def _make_hook(self, i: int) -> Callable[..., None]:
        chunks = self._chunks[i]
        hidden = self.spec.hidden_size

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(x, Tensor):
                raise SpecPrefetchError(f"router of MoE layer {self.spec.moe_layers[i]} was called without a "
                                        "tensor input; cannot capture it")
            chunks.append(x.detach().reshape(-1, hidden))

        return hook

    def _make_pre_hook(self, chunks: list[Tensor]) -> Callable[..., None]:
        hidden = self.spec.hidden_size

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            chunks.append(output.detach().reshape(-1, hidden))

        return hook

    def __enter__(self) -> RouterCapture:
        if self._handles:
            raise SpecPrefetchError("RouterCapture is already active (not re-entrant)")
        for i, gate in enumerate(self.spec.gates):
            self._handles.append(gate.register_forward_pre_hook(self._make_hook(i), with_kwargs=True))
        for norm, chunks in zip(self.spec.pre_norms, self._pre or []):
            self._handles.append(norm.register_forward_hook(self._make_pre_hook(chunks)))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the hooks (also done on exit); what was captured stays readable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- results
    def clear(self) -> None:
        for c in [*self._chunks, *(self._pre or [])]:
            c.clear()

    @property
    def n_forwards(self) -> int:
        return len(self._chunks[0]) if self._chunks else 0

    def inputs(self) -> list[Tensor]:
        """Router inputs, one ``[tokens, D]`` tensor per MoE layer in order (tokens of all captured forwards)."""
        return self._joined(self._chunks, "router input")

    def pre_attention_inputs(self) -> list[Tensor]:
        """The pre-attention norm's outputs (what each MoE layer's attention read), ``[tokens, D]`` per MoE layer."""
        if self._pre is None:
            raise SpecPrefetchError("RouterCapture was made without pre_attention=True")
        return self._joined(self._pre, "pre-attention input")

    def _joined(self, per_layer: list[list[Tensor]], what: str) -> list[Tensor]:
        out = []
        for i, chunks in enumerate(per_layer):
            if not chunks:
                raise SpecPrefetchError(f"no {what} captured for MoE layer {self.spec.moe_layers[i]} "
                                        "(run a forward inside the RouterCapture block)")
            x = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)
            if self.to_cpu:
                x = x.cpu()
            if self.dtype is not None:
                x = x.to(self.dtype)
            out.append(x)
        return out

    def logits(self) -> list[Tensor]:
        """Float32 router logits recomputed from each gate's weight: ``[tokens, n]`` per MoE layer."""
        xs = self._raw()
        return [self.spec.logits(i, x) for i, x in enumerate(xs)]

    def executed_topk(self) -> list[Tensor]:
        """The experts each layer executed (replayed in the model's own dtype): ``[tokens, K]`` per layer."""
        xs = self._raw()
        return [self.spec.executed_topk(i, x) for i, x in enumerate(xs)]

    def _raw(self) -> list[Tensor]:
        saved = (self.to_cpu, self.dtype)
        self.to_cpu, self.dtype = False, None
        try:
            return self.inputs()
        finally:
            self.to_cpu, self.dtype = saved
