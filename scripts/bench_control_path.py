"""The runtime's control path per MoE layer of a decoding step: prediction + selection + issue, beyond the matmul.

    python scripts/bench_control_path.py [--reps 20000] [--threads 1]

For SpecPrefetch adapters at the stand-in's and at DeepSeek-VL2-Tiny's shapes (D, n, r), one token:

- ``matmul``: the adapter's two matmuls alone (numpy, what the runtime runs on the CPU);
- ``scores``: ``PredictorPriority.scores`` (the provider call the runtime makes);
- ``select``: the exclusion set of the cache plus ``select_prefetch`` (Top-M_max of the experts neither resident
  nor in flight);
- ``control``: what the runtime's per-layer loop does at ``t_pred`` for PRED0 (``LayerLoop.predict``: predict,
  select, no issue) over the wall-clock backend and the runtime's own compute, timed by calling it as the loop does;
- ``beyond matmul`` = control − matmul, per round: the target of the device-benchmark issue is ≤ 10 µs.

Each figure is the median over 7 rounds of ``reps`` calls (µs per call); the spread is the min–max of the rounds.
Within a round the four run one after another, so the difference is taken over the same second of a noisy host.
A benchmark script, not a test: its numbers go in notes, never in assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def per_call_us(fns: dict[str, Callable[[], object]], reps: int, rounds: int = 7) -> dict[str, list[float]]:
    """µs per call of every function, ``rounds`` rounds; within a round the functions run one after another (in a
    rotating order), so a difference of two is taken within one round, over the same second of a noisy host."""
    for fn in fns.values():
        for _ in range(min(reps, 1000)):
            fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[k]
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[k].append((time.perf_counter() - t0) / reps * 1e6)
    return out


def adapter(d: int, n: int, r: int, n_layers: int = 4):
    from specprefetch.predictors.base import PredictorDims, build_predictor

    torch.manual_seed(0)
    dims = PredictorDims(n_layers=n_layers, hidden_size=d, n_experts=n, top_k=6, scoring="softmax", arch="test")
    pred = build_predictor("specprefetch", {"specprefetch": {"rank": r}}, dims)
    with torch.no_grad():
        pred.B.normal_()
    return pred


def control_path_us(d: int, n: int, r: int, m_max: int, reps: int) -> dict[str, tuple[float, float, float]]:
    from specprefetch.runtime.core.cache import ExpertCache
    from specprefetch.runtime.core.engine import _LayerCompute
    from specprefetch.runtime.core.layer import LayerLoop
    from specprefetch.runtime.core.priority import PredictorPriority, select_prefetch
    from specprefetch.runtime.core.timeline import LayerEvent
    from specprefetch.runtime.core.transfer import TransferEngine

    pred = adapter(d, n, r)
    prov = PredictorPriority(pred)
    x = torch.randn(1, d)
    a_t, b_t = prov._np_chain[0]
    cache = ExpertCache(4 * n)
    for e in range(0, n, 5):  # a realistic exclusion set: some experts of the next layer resident
        cache.reserve((1, e))
        cache.fill((1, e))
    s = prov.scores(0, x)

    # the runtime's loop and compute; PRED0 issues nothing, so the engine is only read for its wall clock (no
    # workers are started)
    loop = LayerLoop(cache, TransferEngine.__new__(TransferEngine), prov, issues=False, n_layers=4, n_experts=n,
                     budget_of=lambda layer: m_max)
    work = _LayerCompute(None, None, x, None, None)
    ev = LayerEvent(step=1, layer=0, n_tokens=1, t_exec=0.0, required=[], hits=0, inflight=0, misses=0,
                    ready_pairs=0, t_ready=0.0, t_compute=0.0)
    t = per_call_us({
        "matmul": lambda: (x.numpy()[0] @ a_t) @ b_t,
        "scores": lambda: prov.scores(0, x),
        "select": lambda: select_prefetch(s, cache.unavailable_mask_of_layer(1), m_max),
        "control": lambda: loop.predict(ev, 1, 0, work, set()),
    }, reps)
    t["beyond matmul"] = [c - m for c, m in zip(t["control"], t["matmul"])]
    return {k: (statistics.median(v), min(v), max(v)) for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {args.threads} thread(s); µs per call, "
          "median [min-max] of 7 rounds")
    for label, (d, n, r, m) in {"stand-in (D=128, n=64, r=16)": (128, 64, 16, 6),
                                "DeepSeek-VL2-Tiny (D=1280, n=64, r=64)": (1280, 64, 64, 8),
                                "Qwen3-VL-30B-A3B (D=2048, n=128, r=64)": (2048, 128, 64, 8)}.items():
        res = control_path_us(d, n, r, m, args.reps)
        cells = ", ".join(f"{k} {v[0]:.1f} [{v[1]:.1f}-{v[2]:.1f}]" for k, v in res.items())
        print(f"{label}, M_max={m}: {cells}")


if __name__ == "__main__":
    main()
