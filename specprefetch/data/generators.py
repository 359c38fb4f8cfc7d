"""The synthetic generators by config name: ``fn(seed, index, image_size) -> Draft``.

Sample ``index`` depends only on (generator, seed, index), so a workload of n samples is a prefix of one of
m > n samples, and the corpus (other seeds) never reuses a workload's RNG streams.
"""

from __future__ import annotations

from collections.abc import Callable

from specprefetch.data.draft import Draft
from specprefetch.data.synth_chart import generate_chart
from specprefetch.data.synth_gsm8k import generate_gsm8k
from specprefetch.data.synth_hallusion import generate_hallusion
from specprefetch.data.synth_ocr import generate_ocr

GENERATORS: dict[str, Callable[[int, int, int], Draft]] = {
    "gsm8k_synth": generate_gsm8k,
    "ocr_synth": generate_ocr,
    "chartqa_synth": generate_chart,
    "hallusion_synth": generate_hallusion,
}
IMAGE_GENERATORS = ("ocr_synth", "chartqa_synth", "hallusion_synth")
