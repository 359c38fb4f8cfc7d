"""What a generator or hub mapper hands to the workload writer, and the seeded sample order they share.

Kept apart from :mod:`specprefetch.data.workloads` (which calls the generators) so the generators depend on this
small module only, and the data package has no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Draft:
    """What a generator or hub mapper produces for one sample before ids, paths and sources are assigned."""

    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict)
    image: Any = None  # PIL.Image.Image or None


def seeded_order(n_total: int, n: int | None, seed: int) -> list[int]:
    """The first ``n`` indices of a seeded permutation of range(n_total) (all of them if n is None or larger)."""
    import random

    order = list(range(n_total))
    random.Random(f"specprefetch/order/{seed}").shuffle(order)
    return order if n is None or n >= n_total else order[:n]
