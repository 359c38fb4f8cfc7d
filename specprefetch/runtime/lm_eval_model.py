"""Accuracy is preserved, shown with a real client: lm-eval generating through the offloaded runtime.

:class:`OffloadedLM` (registered in lm-eval as ``specprefetch-offloaded``) is lm-eval's own ``HFLM`` whose model
has its experts served by an :class:`~specprefetch.runtime.core.engine.OffloadedRuntime` (any policy, storage, budget),
so generation, log-likelihoods and batching are exactly lm-eval's. :func:`evaluate_offloaded` scores the profile's
local tasks (``results/workloads/{w}/lm_eval/*.yaml``) with the plain model and with every policy, and records
whether scores and every generated output are identical.

From the command line: lm-eval loads no plugins, so a bare ``lm_eval --model specprefetch-offloaded`` fails with
"no model for this name found"; ``specprefetch lm-eval`` imports this module (which registers the model) and runs
lm-eval's own CLI with the arguments unchanged (lm-eval's ``--device`` defaults to CUDA: give ``--device cpu``
on a CPU machine)::

    specprefetch lm-eval --model specprefetch-offloaded \\
        --model_args config=config/config.yaml,model=tiny-deepseek-vl2,model_dir=results/models/tiny-deepseek-vl2,\\
store=results/device/store/tiny-deepseek-vl2,policy=specprefetch,m_max=6,\\
predictor=results/predictors/tiny-deepseek-vl2/specprefetch \\
        --device cpu --tasks specprefetch_gsm8k --include_path results/workloads/gsm8k/lm_eval \\
        --limit 8 --output_path results/lm_eval

Without ``m_max=`` the budget is the config's ``device.m_max`` on the given storage (with ``auto``: give
``window=`` a profile-window directory), decided as the pipeline decides it (:mod:`specprefetch.runtime.core.budget`).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from specprefetch.contracts import POLICY
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.runtime.core.engine import OffloadedRuntime, RuntimeOptions
from specprefetch.runtime.core.paper_scale import install_store_experts, match_store
from specprefetch.runtime.core.storage import ExpertReader, make_profile, physical_read_ms
from specprefetch.runtime.core.store import find_moe_blocks

log = logging.getLogger(__name__)

ACCURACY_COLUMNS = ["model", "task", "policy", "metric", "value", "plain_value", "equal_score", "equal_outputs",
                    "n_samples", "storage", "m_max", "compute_opt", "moe_layer_calls", "expert_loads"]


def language_model(model: Any) -> Any:
    """The causal LM lm-eval talks to (the DeepSeek-VL2 stand-in's ``.language``; others are themselves)."""
    return getattr(model, "language", model)


@register_model("specprefetch-offloaded")
class OffloadedLM(HFLM):
    """lm-eval's HFLM over a model whose routed experts come from the offloaded runtime."""

    def __init__(self, config: str | None = None, model: str | None = None, model_dir: str | None = None,
                 store: str | None = None, policy: str = "off", storage: str = "ram", m_max: int | None = None,
                 window: str | None = None, predictor: str | None = None, compute_opt: bool = True,
                 capacity: int | None = None,
                 bundle: Any = None, expert_store: Any = None, provider: Any = None,
                 device: str = "cpu", batch_size: int = 1, **kwargs: Any) -> None:
        from specprefetch.runtime.core.settings import cache_capacity, device_settings
        from specprefetch.runtime.core.store import ExpertStore

        if bundle is None:
            from specprefetch.config import load_config
            from specprefetch.models import load_bundle

            if not (config and model and store):
                raise SpecPrefetchError("specprefetch-offloaded needs config=, model= and store= model_args")
            cfg = load_config(config)
            bundle = load_bundle(cfg, model, model_dir)
            settings = device_settings(cfg)
        else:  # in-process (evaluate_offloaded): the runtime's own choices come from the arguments
            from specprefetch.config import section_defaults

            settings = section_defaults("device")
        if expert_store is None:
            expert_store = ExpertStore(store)
        spec = bundle.routing
        match_store(find_moe_blocks(language_model(bundle.model), spec), expert_store)  # shared experts widened
        pol = POLICY[policy] if policy in POLICY else None
        if pol is None:
            raise SpecPrefetchError(f"specprefetch-offloaded: unknown policy {policy!r} ({', '.join(POLICY)})")
        if provider is None and pol.provider is not None:
            provider = _provider_from(policy, predictor, spec, device)
        if provider is None and pol.predicts and pol.provider is None:
            from specprefetch.runtime.core.priority import builtin_provider

            provider = builtin_provider(policy, spec.n_layers, spec.n_experts)
        if capacity is None:
            capacity = cache_capacity(settings, expert_store.total_experts,
                                      spec.top_k)
        lm = language_model(bundle.model)
        self.reader = ExpertReader(expert_store, make_profile(
            storage, settings, expert_store.layout.payload_bytes,
            lambda: physical_read_ms(expert_store, settings)))
        if m_max is None:
            m_max = default_m_max(settings, storage, window, model)
        opts = RuntimeOptions(policy=policy, m_max=int(m_max), capacity=int(capacity),
                              compute_opt=_as_bool(compute_opt))
        self.runtime = OffloadedRuntime(lm, expert_store, self.reader, opts, provider, spec=spec, device=device)
        self.runtime.install()
        if torch.device(device).type == "cuda":
            lm.to(device)  # non-expert weights only: the experts are served by the runtime's GPU cache
        self.runtime.reset_run()
        super().__init__(pretrained=lm, tokenizer=bundle.tokenizer, batch_size=batch_size, device=device, **kwargs)

    def close(self) -> None:
        """Give the model its experts back and stop the I/O workers."""
        self.runtime.uninstall()
        self.runtime.close()
        self.reader.close()


def default_m_max(settings: dict[str, Any], storage: str, window: str | None, model: str | None) -> int:
    """The budget when ``m_max=`` is not given: the config's ``device.m_max`` on ``storage``, or, when that is
    auto, the window profile's (``window=``: a profile-window directory), as the pipeline decides it
    (:func:`~specprefetch.runtime.core.budget.storage_budgets`)."""
    from specprefetch.runtime.core.budget import read_window_profile, storage_budgets

    profile = read_window_profile(window, model) if window is not None else None
    return storage_budgets(settings, profile, [storage], need="m_max= or window= (a profile-window directory)")[storage]


def _as_bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes")


def _provider_from(policy: str, predictor: str | None, spec: Any, device: str) -> Any:
    from specprefetch.runtime.core.priority import PredictorPriority, fate_from_model

    if predictor:
        from specprefetch.predictors.base import load_predictor

        return PredictorPriority(load_predictor(predictor), device)
    if policy == "fate":
        return PredictorPriority(fate_from_model(spec), device)
    raise SpecPrefetchError(f"policy {policy!r} needs predictor=<dir of a trained predictor>")


def task_paths(cfg: dict[str, Any], tasks_dir: Path, tasks: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(task names, include paths) of the profile's lm-eval tasks.

    A generated or local workload has its own task YAML (``<workload>/lm_eval/<task>.yaml``, written by
    ``prepare-workload``), found through its include path; a hub workload (``generator: hub``) names lm-eval's own
    upstream task, which reads the same hub dataset, so it has no include path (lm-eval's registry finds it).
    """
    names, paths = [], []
    for w, wc in cfg["workloads"].items():
        task = wc.get("lm_eval_task")
        if not task or (tasks is not None and task not in tasks and w not in tasks):
            continue
        names.append(task)
        if wc["generator"] == "hub":
            continue
        d = Path(tasks_dir) / w / "lm_eval"
        if not (d / f"{task}.yaml").is_file():
            raise SpecPrefetchError(f"lm-eval task file not found: {d / (task + '.yaml')} (workload {w})")
        paths.append(str(d))
    if not names:
        raise SpecPrefetchError("no lm-eval tasks to evaluate (workloads.*.lm_eval_task)")
    return names, paths


def _evaluate(lm: Any, names: list[str], paths: list[str], limit: int | None, max_gen_toks: int) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from specprefetch.data.lm_eval_tasks import allow_code_eval

    # upstream tasks (a hub workload's) come from lm-eval's own registry; local ones only from their include paths
    tm = TaskManager(include_path=paths or None, include_defaults=len(paths) < len(names))
    allow_code_eval()
    return simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=limit, log_samples=True,
                           gen_kwargs={"max_gen_toks": max_gen_toks}, bootstrap_iters=0, random_seed=0,
                           numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                           confirm_run_unsafe_code=True)


def _scores(res: dict[str, Any]) -> dict[tuple[str, str], float]:
    out = {}
    for task, metrics in res["results"].items():
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not k.endswith("_stderr") and "stderr" not in k and k != "alias":
                out[(task, k)] = float(v)
    return out


def _outputs(res: dict[str, Any]) -> dict[str, list[Any]]:
    return {task: [s.get("resps") for s in samples] for task, samples in res.get("samples", {}).items()}


def evaluate_offloaded(cfg: dict[str, Any], settings: dict[str, Any], model_name: str, bundle: Any, store: Any,
                       providers: dict[str, Any], tasks_dir: Path, out_csv: str | Path,
                       device: str = "cpu", m_max: int | None = None) -> list[dict[str, Any]]:
    """Score the local tasks with the plain model of the store and through the runtime (budget ``m_max``; default
    the configured ``device.m_max`` on the reference storage: :func:`default_m_max`) for every policy; write the
    CSV."""
    acc = settings["accuracy"]
    names, paths = task_paths(cfg, tasks_dir, acc.get("tasks"))
    limit = acc.get("limit")
    max_gen = int(acc["max_gen_toks"])
    lm_model = language_model(bundle.model)
    if hasattr(lm_model, "set_experts_implementation"):
        lm_model.set_experts_implementation("eager")  # transformers' reference loop
    # the plain model of the store: its experts (widened and 4-bit for a paper-scale store), all resident
    install_store_experts(find_moe_blocks(lm_model, bundle.routing), store, "cpu")
    lm_model.to(device)
    plain = HFLM(pretrained=lm_model, tokenizer=bundle.tokenizer, batch_size=1, device=device)
    ref = _evaluate(plain, names, paths, limit, max_gen)
    ref_scores, ref_out = _scores(ref), _outputs(ref)
    storage = settings["reference_storage"]
    if m_max is None:
        m_max = default_m_max(settings, storage, None, None)
    rows = []
    for policy in acc["policies"]:
        key = POLICY[policy].provider
        provider = providers[key]() if key in providers else None
        lm = OffloadedLM(bundle=bundle, expert_store=store, provider=provider, policy=policy, storage=storage,
                         m_max=m_max, compute_opt=True, device=device,
                         capacity=_capacity(settings, store, bundle.routing.top_k))
        try:
            res = _evaluate(lm, names, paths, limit, max_gen)
        finally:
            lm.close()
        calls = len(lm.runtime.events)  # evidence the runtime served the experts
        loads = sum(1 for tr in lm.runtime.engine.log if tr.state == "done")
        scores, outs = _scores(res), _outputs(res)
        for (task, metric), v in sorted(scores.items()):
            same_out = outs.get(task) == ref_out.get(task)
            rows.append({"model": model_name, "task": task, "policy": policy, "metric": metric, "value": v,
                         "plain_value": ref_scores.get((task, metric)),
                         "equal_score": v == ref_scores.get((task, metric)),
                         "equal_outputs": same_out, "n_samples": len(outs.get(task) or []), "storage": storage,
                         "m_max": m_max, "compute_opt": True, "moe_layer_calls": calls, "expert_loads": loads})
            if not same_out or v != ref_scores.get((task, metric)):
                log.error("%s %s %s: offloaded outputs differ from the plain model", model_name, task, policy)
    with atomic_path(out_csv) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=ACCURACY_COLUMNS, lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
    return rows


def _capacity(settings: dict[str, Any], store: Any, top_k: int) -> int:
    from specprefetch.runtime.core.settings import cache_capacity

    return cache_capacity(settings, store.total_experts, int(top_k))


__all__ = ["ACCURACY_COLUMNS", "OffloadedLM", "default_m_max", "evaluate_offloaded"]
