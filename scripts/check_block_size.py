#!/usr/bin/env python
"""A/A check of the lockstep block size: how well two runs of one block pair, as a function of the block's size.

Every block of size n decodes two identical OFF runs and n - 2 other configurations of ``bench_runtime``'s cold-disk
plan (SpecPrefetch, FATE, Naive, PRED0 at the budget, SpecPrefetch at other budgets, all-resident) in lockstep
(:meth:`Harness.run_lockstep`). The second OFF's "gain" over the first is pure pairing noise: its spread over
repeats is the smallest CI half-width a paired gain measured in such a block can have. In every repeat the block
sizes run in a fresh random order, so slow drift of the host hits every size alike.

    python scripts/check_block_size.py --config config/config.yaml --model tiny-deepseek-vl2 --sizes 2,6,13 \\
        --repeats 6

prints, per size, the per-repeat A/A differences (percent points), their sd and 95 % CI half-width (bootstrap over
repeats, as the tables), and writes them as JSON with ``--out``. Needs the DAG's outputs under ``--workdir`` (the
checkout whose ``results/`` holds a built store, a window profile and the trained predictors: ``snakemake --cores
all paper_tables`` or the rules up to ``profile_window``), found where the pipeline puts them
(:class:`specprefetch.workflow.Pipeline`). The budget is the window profile's M_max for the storage
(:func:`specprefetch.runtime.core.budget.storage_budgets`) unless ``--m-max`` is given.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FILLERS = [("specprefetch", "m"), ("fate", "m"), ("naive", "m"), ("pred0", "m"), ("resident", 0),
           ("specprefetch", 1), ("specprefetch", 2), ("specprefetch", 4), ("specprefetch", 8),
           ("fate", 1), ("naive", 1), ("fate", 2), ("naive", 2)]


def block(n: int, storage: str, m_max: int) -> list[dict[str, Any]]:
    """Two OFF runs and the first ``n - 2`` fillers (``n - 2 <= len(FILLERS)``)."""
    off = {"policy": "off", "storage": storage, "m_max": 0, "compute_opt": True, "record": True}
    rest = [{**off, "policy": p, "m_max": m_max if m == "m" else int(m)} for p, m in FILLERS[:n - 2]]
    return [off, dict(off), *rest]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    ap.add_argument("--model", default="tiny-deepseek-vl2")
    ap.add_argument("--workdir", type=Path, default=REPO, help="the checkout whose results/ the DAG wrote")
    ap.add_argument("--storage", default="nvme_cold")
    ap.add_argument("--sizes", default="4,6,13", help="block sizes, comma-separated (2 to %d)" % (len(FILLERS) + 2))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--m-max", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the per-repeat differences here (JSON)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or any(not 2 <= n <= len(FILLERS) + 2 for n in sizes) or args.repeats < 2:
        ap.error(f"--sizes must be 2..{len(FILLERS) + 2} and --repeats at least 2")

    from specprefetch.config import load_config
    from specprefetch.io import SpecPrefetchError
    from specprefetch.metrics import bootstrap_ci
    from specprefetch.runtime.core.budget import budget_storages, storage_budgets
    from specprefetch.stages.device import _harness, _setup, _window_profile
    from specprefetch.workflow import Pipeline

    w, model = args.workdir, args.model
    try:
        p = Pipeline(load_config(args.config), w)
        settings = p.device
        m_max = args.m_max
        if m_max is None:
            if args.storage not in budget_storages(settings):
                raise SpecPrefetchError(f"--storage {args.storage!r} is not a storage of the device config")
            m_max = storage_budgets(settings, _window_profile(w / p.window_dir(model), model))[args.storage]
        model_dir = p.model_dir(model)
        ns = argparse.Namespace(config=args.config, model=model, model_dir=w / model_dir if model_dir else None,
                                store=w / p.store_dir(model), workload_dir=w / p.workload_dir(p.device_workload),
                                predictor=[f"{m}={w / p.predictor_dir(model, m)}" for m in p.device_predictors],
                                device="cpu")
        harness = _harness(_setup(ns))
    except SpecPrefetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    diffs: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        harness.run("off", args.storage, max_new_tokens=4, prompts=harness.prompts[:1])  # warm-up
        for r in range(args.repeats):
            order = list(sizes)
            random.Random(f"check_block_size/{args.seed}/{r}").shuffle(order)
            for n in order:
                a, b = harness.run_lockstep(block(n, args.storage, m_max), seed=f"{args.seed}/{n}/{r}")[:2]
                diffs[n].append((b.tokens_per_s / a.tokens_per_s - 1.0) * 100.0)
                print(f"repeat {r} size {n:2d}: OFF {a.tokens_per_s:.2f} vs {b.tokens_per_s:.2f} tok/s "
                      f"({diffs[n][-1]:+.2f} pp)", flush=True)
    finally:
        harness.close()
    import numpy as np

    print(f"\n{args.model}, {args.storage}, M_max {m_max}, {args.repeats} repeats x "
          f"{int(settings['max_new_tokens']) - 1} decoded tokens per run\n")
    print("| block size | per repeat (pp) | sd (pp) | 95 % CI half-width (pp) |\n|---:|---|---:|---:|")
    out = {"model": args.model, "storage": args.storage, "m_max": m_max, "repeats": args.repeats, "sizes": {}}
    for n in sizes:
        v = np.asarray(diffs[n])
        ci = bootstrap_ci(v)
        sd = float(np.std(v, ddof=1))
        out["sizes"][str(n)] = {"diffs_pp": v.tolist(), "sd_pp": sd, "ci_half_width_pp": ci.half_width}
        print(f"| {n} | {', '.join(f'{x:+.1f}' for x in v)} | {sd:.2f} | {ci.half_width:.2f} |")
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
