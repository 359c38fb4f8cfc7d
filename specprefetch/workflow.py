"""What the Snakefile needs to know about a config: names, paths, wildcards, per-rule config hashes.

Kept out of the .smk files so the rules stay thin wiring and the logic is tested like any library code.

Shell safety: the ``*_arg``/``*_args`` helpers, ``cli_words`` and ``train_command`` return ready shell words (every
argument quoted with ``shlex``); the rules insert them unquoted (``{params.x}``), everything else with ``:q``.

Paths: every file and directory of the DAG comes from a helper here (or ``specprefetch.render.targets`` for the
rendering); called without names, a helper returns the rule's wildcard pattern (``store_dir()`` is
``"results/device/store/{model}"``), so a rule's output and the inputs that name it cannot drift apart.
"""

from __future__ import annotations

import copy
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from specprefetch import registry
from specprefetch.config import device_settings, trains_online, validate_config
from specprefetch.contracts import read_doc
from specprefetch.io import config_hash, write_text_atomic
from specprefetch.predictors.sizing import check_size_rules, seed_count, seed_indices
from specprefetch.render.targets import ARCHIVE_SUBDIR, RESULT_PATHS, out_dir

CORPUS = "corpus"
# Expensive deterministic rules whose outputs `snakemake --cache` shares between working directories.
CACHEABLE_RULES = ("prepare_corpus", "train_tokenizer", "pretrain_stand_in", "extract_traces")
# The software of every rule (one environment: every rule runs the same library), for the rules' `conda:`.
CONDA_ENV = "envs/specprefetch.yaml"


def shell_args(*args: str | int | list[str] | tuple[str, ...]) -> str:
    """Shell words for a command line: each argument quoted on its own (a list/tuple argument: each element)."""
    words: list[str] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            words.extend(str(x) for x in a)
        else:
            words.append(str(a))
    return shlex.join(words)


def untracked(value: str) -> Callable[..., str]:
    """A rule param (``params: x=untracked(value)``) whose value Snakemake's params rerun trigger does not record.

    Snakemake records each param's value with a job's outputs and reruns the job when it differs, except for params
    computed from the job's input or output (their changes show there): this function takes ``input``, so its value
    is left out. For values another trigger covers: the interpreter (the software) and the resolved config's path,
    named by the hash of the *whole* config, while each rule's ``cfg`` param records the hash of the sections it reads
    (a config change reruns exactly the jobs it affects). The value still reaches the shell, the printed commands and
    the between-workflow cache key (which hashes every param)."""

    def param(wildcards: Any, input: Any) -> str:  # Snakemake passes the job's input by that name
        return value

    return param


class Pipeline:
    """The validated config of one profile, and the file layout of its results.

    ``python`` runs the CLI in every job (the interpreter that runs Snakemake, or ``python`` of the rules' conda
    environment); ``cores`` is Snakemake's ``--cores`` (None without it); ``cache`` is its ``--cache`` (None without
    it, [] for every cacheable rule, else the rules it names)."""

    untracked = staticmethod(untracked)

    def __init__(self, config: dict[str, Any], workdir: str | Path = ".",
                 config_files: Sequence[str | Path] = (), *, python: str = sys.executable,
                 cores: int | None = None, cache: Sequence[str] | None = None) -> None:
        self.workdir = Path(workdir)
        for path in config_files:  # duplicate keys, encodings: what Snakemake's own loader lets through
            read_doc(path, None, "config file", kind="yaml")
        validate_config(config, self.workdir)
        seed_count(config)  # predictors.seeds and the size rules: one line naming the key, before any job
        check_size_rules(config)
        self.cfg = copy.deepcopy(config)
        self.config_path = self._write_resolved_config()
        self.python = python
        self.cores = cores
        self.cached_rules = frozenset(r for r in CACHEABLE_RULES if cache is not None and (not cache or r in cache))

    # ---------------------------------------------------------------- names
    @property
    def models(self) -> list[str]:
        return list(self.cfg["models"])

    @property
    def stand_ins(self) -> list[str]:
        return [m for m, v in self.cfg["models"].items() if v["source"] == "stand_in"]

    @property
    def workloads(self) -> list[str]:
        return list(self.cfg["workloads"])

    @property
    def methods(self) -> list[str]:
        return list(self.cfg["predictors"]["methods"])

    @staticmethod
    def regex(names: list[str]) -> str:
        return "|".join(re.escape(n) for n in names)

    # ---------------------------------------------------------------- config
    def _write_resolved_config(self) -> str:
        """Write the resolved config once per content (never touched again, so no spurious reruns)."""
        text = yaml.safe_dump(self.cfg, sort_keys=False)
        path = Path(".snakemake") / "specprefetch" / f"config-{config_hash(self.cfg)}.yaml"
        if not path.exists() or path.read_text() != text:
            write_text_atomic(path, text)
        return str(path)

    def hash_of(self, *keys: str, model: str | None = None, workload: str | None = None) -> str:
        """Hash of the config sections a job depends on: a change reruns exactly the affected jobs."""
        frag: dict[str, Any] = {k: self.cfg.get(k) for k in keys}
        if model is not None:
            frag["model"] = self.cfg["models"][model]
        if workload is not None and workload != CORPUS:
            frag["workload"] = self.cfg["workloads"][workload]
        return config_hash(frag)

    def store_hash(self, model: str) -> str:
        """What a model's expert store depends on: the model, its paper-scale widening and the seed."""
        return config_hash({"model": self.cfg["models"][model], "seed": self.cfg.get("seed"),
                            "paper_scale": self.cfg["device"]["paper_scale"].get(model)})

    def order_hash(self) -> str:
        """Hash of the order of models and workloads (config_hash ignores mapping order; the tables do not)."""
        return config_hash([list(self.cfg["models"]), list(self.cfg["workloads"])])[:12]

    def render_hash(self) -> str:
        """What the rendering depends on; the tables follow the config's order of models and workloads (the paper's),
        so the order is part of it."""
        return f"{self.hash_of('models', 'workloads', 'recall', 'predictors', 'render')}-{self.order_hash()}"

    # ---------------------------------------------------------------- rule params (not files)
    @property
    def cli_words(self) -> str:
        """``python -m specprefetch``, as shell words (the interpreter quoted)."""
        return shell_args(self.python, "-m", "specprefetch")

    @property
    def cli(self) -> Callable[..., str]:
        """The ``cli`` param of every rule: :attr:`cli_words`, out of the params trigger (the interpreter's path
        differs between ``snakemake`` and ``python3 -m snakemake`` without any change to the software)."""
        return untracked(self.cli_words)

    @property
    def config_param(self) -> Callable[..., str]:
        """The ``config`` param of every rule: the resolved config's path, out of the params trigger (see
        :func:`untracked`; the rule's ``cfg`` param tracks the sections it reads)."""
        return untracked(self.config_path)

    @property
    def conda_env(self) -> str:
        return str(self.workdir / CONDA_ENV)

    @property
    def exclusive_threads(self) -> int:
        """Threads of the timing rules: every core when --cores is given, so nothing else runs while they measure;
        1 when it is not (e.g. ``snakemake --report``, which runs nothing)."""
        return self.cores or 1

    def cache_mode(self, rule: str) -> str | bool:
        """The rule's ``cache:`` directive: between-workflow caching when ``--cache`` asks for it, else none."""
        return "omit-software" if rule in self.cached_rules else False

    # ---------------------------------------------------------------- paths
    # Logs and benchmarks: one file per job under logs/<rule>/ and benchmarks/<rule>/, named by its wildcards.
    def log_path(self, rule: str, name: str) -> str:
        return f"logs/{rule}/{name}.log"

    def benchmark_path(self, rule: str, name: str) -> str:
        return f"benchmarks/{rule}/{name}.tsv"

    @staticmethod
    def parent_dir(paths: str | Sequence[str]) -> str:
        """The directory of a job's output or input file (of the first, for a list), for a CLI's ``--out-dir``: the
        rules derive such params from their files (``lambda w, output: P.parent_dir(output.x)``), so the directory
        follows the files wherever Snakemake puts them, and the params trigger leaves it to the files."""
        return str(PurePosixPath(paths if isinstance(paths, str) else paths[0]).parent)

    @property
    def corpus_dir(self) -> str:
        return "results/corpus"

    @property
    def tokenizer_dir(self) -> str:
        return "results/tokenizer"

    def workload_dir(self, workload: str = "{workload}") -> str:
        return self.corpus_dir if workload == CORPUS else f"results/workloads/{workload}"

    def workload_dirs(self) -> list[str]:
        return [self.workload_dir(w) for w in self.workloads]

    @property
    def disjointness_json(self) -> str:
        return "results/workloads/disjointness.json"

    def stand_in_dir(self, model: str = "{model}") -> str:
        return f"results/models/{model}"

    @staticmethod
    def result_path(name: str) -> str:
        """A gathered result the rendering reads (``render.targets.RESULT_PATHS``: recall, per_layer, params, runs,
        window, window_events, latency, ..., predictor_cost)."""
        return RESULT_PATHS[name]

    def model_dir(self, model: str) -> str | None:
        """Where a model's weights come from: the pipeline's stand-in, a local copy, or None (the hub)."""
        m = self.cfg["models"][model]
        if m["source"] == "stand_in":
            return self.stand_in_dir(model)
        if m["source"] == "local":
            return m["path"]
        return None

    def model_inputs(self, model: str) -> list[str]:
        d = self.model_dir(model)
        return [d] if d is not None and self.cfg["models"][model]["source"] == "stand_in" else []

    def model_dir_arg(self, model: str) -> str:
        d = self.model_dir(model)
        return shell_args("--model-dir", d) if d else ""

    def predictor_args(self, model: str, methods: Iterable[str], every_seed: bool = False,
                       lookahead: bool = False) -> str:
        """``--predictor METHOD=DIR ...`` for the CLI (quoted shell words): seed 0 of each method, with
        ``every_seed`` each of its seeds (evaluate_recall), with ``lookahead`` every seed and look-ahead distance of
        the look-ahead methods (``methods`` unused: evaluate_lookahead)."""
        if lookahead:
            pairs = self.lookahead_predictor_dirs(model)
        elif every_seed:
            pairs = self.seeded_predictor_dirs(model, methods)
        else:
            pairs = [(m, self.predictor_dir(model, m)) for m in methods]
        return shell_args(*[w for m, d in pairs for w in ("--predictor", f"{m}={d}")])

    @staticmethod
    def traces_arg(traces: str | list[str] | None) -> str:
        """``--traces DIR`` (quoted shell words), or nothing when the job reads no traces (online training)."""
        return shell_args("--traces", traces) if traces else ""

    def trace_dir(self, model: str = "{model}", workload: str = "{workload}") -> str:
        """A whole trace set, gathered from its scatter shards."""
        return f"results/traces/{model}/{workload}"

    def trace_shard_dir(self, model: str = "{model}", workload: str = "{workload}",
                        shard: int | str = "{shard}") -> str:
        return f"results/trace_shards/{model}/{workload}/{shard}"

    @property
    def trains_on_traces(self) -> bool:
        """Predictors learn from stored corpus traces (source: traces) or from the live model (source: online)."""
        return not trains_online(self.cfg)

    def train_inputs(self, model: str) -> dict[str, Any]:
        """What train_predictor reads: the corpus, the model, and the corpus traces unless training online."""
        inputs: dict[str, Any] = {"corpus": self.corpus_dir, "model": self.model_inputs(model)}
        if self.trains_on_traces:
            inputs["traces"] = self.trace_dir(model, CORPUS)
        return inputs

    def train_command(self, python: str) -> str:
        """How train_predictor starts: ``python -m specprefetch``, or the configured multi-process launcher
        (``predictors.training.launcher``, e.g. torchrun) running the same module.

        Returns shell words. The launcher is a command *by design* (a user-supplied prefix such as
        ``torchrun --standalone --nproc_per_node=4``): it is inserted as shell words, not quoted, so only
        trusted text belongs there. The interpreter path and the module name are quoted."""
        launcher = self.cfg["predictors"]["training"].get("launcher")
        module = shell_args("-m", "specprefetch")
        return f"{launcher} {module}" if launcher else f"{shell_args(python)} {module}"

    @property
    def scatter(self) -> int:
        """Extraction (and recall evaluation) jobs per trace set: config traces.scatter (default 1)."""
        return int(self.cfg["traces"]["scatter"])

    def trace_shard_dirs(self, model: str, workload: str) -> list[str]:
        return [self.trace_shard_dir(model, workload, i) for i in range(self.scatter)]

    # Seeds (predictors.seeds): seed index 0 of a method lives in results/predictors/<model>/<method> (what the
    # runtime, Table 3 and a single-seed profile use), seed k >= 1 of a learned method beside it in
    # <method>.seed<k>; the rule's {seed_tag} wildcard is "" or ".seed<k>".
    SEED_TAG = r"(\.seed[1-9][0-9]*)?"
    # Look-ahead (predictors.lookahead, beyond the paper): a predictor of distance d >= 2 lives in
    # <method>.d<d>[.seed<k>] beside the paper's next-layer one; the {ahead_tag} wildcard is "" (d = 1) or ".d<d>".
    AHEAD_TAG = r"(\.d([2-9]|[1-9][0-9]+))?"

    @property
    def seeds(self) -> int:
        """How many seeds each learned predictor is trained with (predictors.seeds, absent: 1)."""
        return seed_count(self.cfg)

    def method_seeds(self, method: str) -> list[int]:
        """The seed indices ``method`` is trained with: every seed when learned, 0 when training-free."""
        return seed_indices(self.cfg, self.is_learned(method))

    @staticmethod
    def seed_tag(seed: int) -> str:
        return "" if int(seed) == 0 else f".seed{int(seed)}"

    @staticmethod
    def seed_index(tag: str) -> int:
        """The seed index of a ``{seed_tag}`` wildcard value ("" is 0, ".seed3" is 3)."""
        return int(tag.removeprefix(".seed")) if tag else 0

    @staticmethod
    def ahead_tag(d: int) -> str:
        from specprefetch.predictors.base import ahead_tag

        return ahead_tag(d)

    @staticmethod
    def lookahead_of(tag: str) -> int:
        """The look-ahead distance of an ``{ahead_tag}`` wildcard value ("" is 1, ".d3" is 3)."""
        return int(tag.removeprefix(".d")) if tag else 1

    def predictor_dir(self, model: str = "{model}", method: str = "{method}", seed: int | str = 0,
                      ahead: int | str = 1) -> str:
        """A saved predictor; ``seed`` an index and ``ahead`` a distance, or wildcard patterns such as
        ``"{seed_tag}"`` and ``"{ahead_tag}"``."""
        tag = seed if isinstance(seed, str) else self.seed_tag(seed)
        dtag = ahead if isinstance(ahead, str) else self.ahead_tag(ahead)
        return f"results/predictors/{model}/{method}{dtag}{tag}"

    def lookahead_distances(self, model: str) -> list[int]:
        """The look-ahead distances d (predictors.lookahead.distances) ``model`` has pairs for (d < its MoE layers),
        1 always among them (the paper's predictors are the reference)."""
        from specprefetch.config import n_moe_layers

        n = n_moe_layers(self.cfg["models"][model])
        return sorted({1, *(d for d in self.cfg["predictors"]["lookahead"]["distances"] if d < n)})

    @property
    def lookahead_methods(self) -> list[str]:
        """The methods scored at every look-ahead distance (predictors.lookahead.methods), in methods order."""
        chosen = set(self.cfg["predictors"]["lookahead"]["methods"])
        return [m for m in self.methods if m in chosen]

    def lookahead_predictor_dirs(self, model: str) -> list[tuple[str, str]]:
        """(method, dir) of every look-ahead method, distance and seed of ``model`` (d = 1: the paper's predictors)."""
        return [(m, self.predictor_dir(model, m, k, d)) for m in self.lookahead_methods
                for d in self.lookahead_distances(model) for k in self.method_seeds(m)]

    def lookahead_csv(self, model: str = "{model}", workload: str = "{workload}", shard: int | str = "{shard}") -> str:
        return f"results/recall/lookahead/{model}/{workload}/{shard}.csv"

    def lookahead_csvs(self) -> list[str]:
        return [self.lookahead_csv(m, w, i) for m in self.models for w in self.workloads for i in range(self.scatter)]

    def seeded_predictor_dirs(self, model: str, methods: Iterable[str]) -> list[tuple[str, str]]:
        """(method, dir) of every seed of each method, in method order."""
        return [(m, self.predictor_dir(model, m, k)) for m in methods for k in self.method_seeds(m)]

    def train_hash(self, model: str) -> str:
        """What one trained predictor depends on: the predictors section without the seed count (adding a seed
        trains the new seed only) and the look-ahead choice (the job's own distance is in its path) and the
        model."""
        frag = {"predictors": {k: v for k, v in self.cfg["predictors"].items() if k not in ("seeds", "lookahead")},
                "model": self.cfg["models"][model]}
        return config_hash(frag)

    def recall_csv(self, model: str = "{model}", workload: str = "{workload}", shard: int | str = "{shard}") -> str:
        return f"results/recall/{model}/{workload}/{shard}.csv"

    def realism_inputs(self) -> list[str]:
        """What measure_realism reads: every evaluation workload's trace shards, of every model (the shards of a set
        are measured together, so no gather job is needed)."""
        return [d for m in self.models for w in self.workloads for d in self.trace_shard_dirs(m, w)]

    def is_learned(self, method: str) -> bool:
        """Trained (the registry's flag, plugins included), not fitted from statistics or built from the gates."""
        return registry.method(method).learned

    # ---------------------------------------------------------------- targets
    def recall_csvs(self) -> list[str]:
        return [self.recall_csv(m, w, i) for m in self.models for w in self.workloads for i in range(self.scatter)]

    def predictor_dirs(self) -> list[str]:
        return [self.predictor_dir(m, meth) for m in self.models for meth in self.methods]

    def paper_table_inputs(self) -> list[str]:
        return [self.disjointness_json, self.result_path("recall"), self.result_path("params"),
                self.numbers_file("md"), self.numbers_file("json")]

    def numbers_file(self, kind: str = "md") -> str:
        """The measured numbers the docs cite, each with its source (``render.numbers``), beside the rendering:
        ``md``, ``json``, or ``sim_validation`` (the simulator's validation, archived with the rendering inputs so
        the page cites a file committed with it)."""
        if kind == "sim_validation":
            return f"{out_dir(self.cfg)}/{ARCHIVE_SUBDIR}/sim_validation.csv"
        return f"{out_dir(self.cfg)}/numbers.{kind}"

    # ---------------------------------------------------------------- device (offloaded runtime)
    @cached_property
    def device(self) -> dict[str, Any]:
        """The ``device`` section over its defaults (specprefetch.config.device_settings)."""
        return device_settings(self.cfg)

    @property
    def device_models(self) -> list[str]:
        return list(self.device["models"])

    @property
    def device_workload(self) -> str:
        return self.device["workload"]

    @property
    def device_sim_workloads(self) -> list[str]:
        """The workloads whose traces the simulator replays (default: the runtime's workload)."""
        return list(self.device["simulator"]["workloads"] or [self.device_workload])

    @property
    def device_predictors(self) -> list[str]:
        """The predictors the runtime prefetches with: every runtime policy's provider (registry order: SpecPrefetch,
        FATE, then plugins that declare a runtime policy) that the profile trains."""
        return [m for m in registry.runtime_providers() if m in self.methods]

    def device_lookahead_dirs(self, model: str) -> list[tuple[str, str]]:
        """(name, dir) of the SpecPrefetch predictors the lookahead experiment prefetches with beyond d = 1 (seed 0;
        ``specprefetch.d2``...), where ``model`` runs that experiment; none otherwise."""
        from specprefetch.predictors.base import ahead_name
        from specprefetch.runtime.core.settings import experiments_for

        if "lookahead" not in experiments_for(self.device, model):
            return []
        return [(ahead_name("specprefetch", d), self.predictor_dir(model, "specprefetch", 0, d))
                for d in self.device["lookahead"]["distances"] if d != 1]

    def device_predictor_dirs(self, model: str) -> list[str]:
        return [self.predictor_dir(model, m) for m in self.device_predictors] + \
            [d for _, d in self.device_lookahead_dirs(model)]

    def device_predictor_args(self, model: str) -> str:
        """``--predictor NAME=DIR ...`` of the runtime's predictors (quoted shell words), the look-ahead ones
        named by their distance (``specprefetch.d2=...``)."""
        return " ".join(a for a in (self.predictor_args(model, self.device_predictors),
                                    shell_args(*[w for n, d in self.device_lookahead_dirs(model)
                                                 for w in ("--predictor", f"{n}={d}")])) if a)

    def store_dir(self, model: str = "{model}") -> str:
        return f"results/device/store/{model}"

    # A variant's window profile and runs (device.variants) sit beside the default's, tagged "@<variant>"; the
    # default's tag is empty. The rules that measure take the tag as a wildcard.
    VARIANT_TAG = r"(@[a-z][a-z0-9_]*)?"

    def window_dir(self, model: str = "{model}", tag: str = "") -> str:
        return f"results/device/window/{model}{tag}"

    def measured_csv(self, model: str = "{model}", tag: str = "") -> str:
        return f"results/device/measured/{model}{tag}.csv"

    def routing_file(self, model: str = "{model}", tag: str = "") -> str:
        return f"results/device/measured/{model}{tag}.routing.safetensors"

    def device_benchmarks(self) -> list[tuple[str, str]]:
        """Every (model, variant tag) the runtime is benchmarked in: each model's default, then its variants."""
        from specprefetch.runtime.core.settings import variants_for

        return [(m, "") for m in self.device_models] + [(m, f"@{v}") for m in self.device_models
                                                       for v in variants_for(self.device, m)]

    @staticmethod
    def variant_arg(tag: str) -> str:
        """``--variant NAME`` for a variant's tag ("" for the default)."""
        return shell_args("--variant", tag[1:]) if tag else ""

    def simulated_csv(self, model: str = "{model}") -> str:
        return f"results/device/simulated/{model}.csv"

    def sim_validation_csv(self, model: str = "{model}", tag: str = "") -> str:
        return f"results/device/sim_validation/{model}{tag}.csv"

    def accuracy_csv(self, model: str = "{model}") -> str:
        return f"results/device/accuracy/{model}.csv"

    def accuracy_csvs(self) -> list[str]:
        return [self.accuracy_csv(m) for m in self.device_models]

    @property
    def sim_validation_table(self) -> str:
        """Every model's simulator validation, gathered by collect_device_benchmarks."""
        return "results/device/sim_validation.csv"

    # ---------------------------------------------------------------- scheduling
    # Per-rule resources for local runs and the SLURM profile. The paper profile's heavy rules need a GPU
    # (a 30B-parameter model); the embedded and smoke profiles run everything on the CPU.
    _RESOURCES: dict[str, dict[str, dict[str, int]]] = {
        "prepare_workload": {"cpu": {"mem_mb": 2000, "runtime": 30}, "paper": {"mem_mb": 16000, "runtime": 120}},
        "prepare_corpus": {"cpu": {"mem_mb": 2000, "runtime": 30}, "paper": {"mem_mb": 32000, "runtime": 240}},
        "train_tokenizer": {"cpu": {"mem_mb": 2000, "runtime": 30}, "paper": {"mem_mb": 8000, "runtime": 60}},
        "check_disjoint": {"cpu": {"mem_mb": 1000, "runtime": 10}, "paper": {"mem_mb": 8000, "runtime": 60}},
        "pretrain_stand_in": {"cpu": {"mem_mb": 6000, "runtime": 60}, "paper": {"mem_mb": 6000, "runtime": 60}},
        "extract_traces": {"cpu": {"mem_mb": 4000, "runtime": 60},
                           "paper": {"mem_mb": 96000, "runtime": 720, "gpu": 1}},
        "train_predictor": {"cpu": {"mem_mb": 4000, "runtime": 60},
                            "paper": {"mem_mb": 128000, "runtime": 1440, "gpu": 1}},
        "evaluate_recall": {"cpu": {"mem_mb": 4000, "runtime": 30},
                            "paper": {"mem_mb": 64000, "runtime": 240, "gpu": 1}},
        "evaluate_lookahead": {"cpu": {"mem_mb": 4000, "runtime": 30},
                               "paper": {"mem_mb": 64000, "runtime": 240, "gpu": 1}},
        "build_expert_store": {"cpu": {"mem_mb": 2000, "runtime": 20}, "paper": {"mem_mb": 128000, "runtime": 120}},
        "profile_window": {"cpu": {"mem_mb": 4000, "runtime": 30},
                           "paper": {"mem_mb": 128000, "runtime": 120, "gpu": 1}},
        "bench_runtime": {"cpu": {"mem_mb": 4000, "runtime": 120},
                          "paper": {"mem_mb": 128000, "runtime": 720, "gpu": 1}},
        "simulate_device": {"cpu": {"mem_mb": 4000, "runtime": 30}, "paper": {"mem_mb": 32000, "runtime": 120}},
        "validate_simulator": {"cpu": {"mem_mb": 4000, "runtime": 30}, "paper": {"mem_mb": 16000, "runtime": 60}},
        "evaluate_offloaded": {"cpu": {"mem_mb": 4000, "runtime": 60},
                               "paper": {"mem_mb": 128000, "runtime": 720, "gpu": 1}},
        # gathering and rendering: small, the same for every profile (most are localrules)
        "gather_traces": {"cpu": {"mem_mb": 2000, "runtime": 30}, "paper": {"mem_mb": 2000, "runtime": 30}},
        "gather_recall": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "gather_lookahead": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "gather_params": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "measure_predictor_cost": {"cpu": {"mem_mb": 2000, "runtime": 20}, "paper": {"mem_mb": 16000, "runtime": 60}},
        "measure_realism": {"cpu": {"mem_mb": 2000, "runtime": 10}, "paper": {"mem_mb": 16000, "runtime": 240}},
        "collect_device_benchmarks": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "archive_results": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "render_table": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "render_figure": {"cpu": {"mem_mb": 2000, "runtime": 5}, "paper": {"mem_mb": 2000, "runtime": 5}},
        "compare_with_paper": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
        "write_preview": {"cpu": {"mem_mb": 500, "runtime": 5}, "paper": {"mem_mb": 500, "runtime": 5}},
        "compile_preview": {"cpu": {"mem_mb": 1000, "runtime": 10}, "paper": {"mem_mb": 1000, "runtime": 10}},
        "write_numbers": {"cpu": {"mem_mb": 1000, "runtime": 5}, "paper": {"mem_mb": 1000, "runtime": 5}},
    }

    def resources(self, rule: str) -> dict[str, int]:
        kind = "paper" if self.cfg["profile"] == "paper" else "cpu"
        res = {"gpu": 0, **self._RESOURCES[rule][kind]}
        return res
