"""What the Snakefile needs to know about a config: names, paths, wildcards, per-rule config hashes.

Kept out of the .smk files so the rules stay thin wiring and the logic is tested like any library code.

Shell safety: the ``*_arg``/``*_args`` helpers and ``train_command`` return ready shell words (every argument
quoted with ``shlex``); the rules insert them unquoted (``{params.x}``), everything else with ``:q``.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from specprefetch.config import LEARNED_METHODS, trains_online, validate_config
from specprefetch.contracts import read_doc
from specprefetch.io import config_hash, write_text_atomic

CORPUS = "corpus"


def shell_args(*args: str | int | list[str] | tuple[str, ...]) -> str:
    """Shell words for a command line: each argument quoted on its own (a list/tuple argument: each element)."""
    words: list[str] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            words.extend(str(x) for x in a)
        else:
            words.append(str(a))
    return shlex.join(words)


class Pipeline:
    """The validated config of one profile, and the file layout of its results."""

    def __init__(self, config: dict[str, Any], workdir: str | Path = ".",
                 config_files: Sequence[str | Path] = ()) -> None:
        self.workdir = Path(workdir)
        for path in config_files:  # duplicate keys, encodings: what Snakemake's own loader lets through
            read_doc(path, None, "config file", kind="yaml")
        validate_config(config, self.workdir)
        self.cfg = copy.deepcopy(config)
        self.config_path = self._write_resolved_config()

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

    def order_hash(self) -> str:
        """Hash of the order of models and workloads (config_hash ignores mapping order; the tables do not)."""
        return config_hash([list(self.cfg["models"]), list(self.cfg["workloads"])])[:12]

    # ---------------------------------------------------------------- paths
    def workload_dir(self, workload: str) -> str:
        return "results/corpus" if workload == CORPUS else f"results/workloads/{workload}"

    def model_dir(self, model: str) -> str | None:
        """Where a model's weights come from: the pipeline's stand-in, a local copy, or None (the hub)."""
        m = self.cfg["models"][model]
        if m["source"] == "stand_in":
            return f"results/models/{model}"
        if m["source"] == "local":
            return m["path"]
        return None

    def model_inputs(self, model: str) -> list[str]:
        d = self.model_dir(model)
        return [d] if d is not None and self.cfg["models"][model]["source"] == "stand_in" else []

    def model_dir_arg(self, model: str) -> str:
        d = self.model_dir(model)
        return shell_args("--model-dir", d) if d else ""

    def predictor_args(self, model: str, methods: Iterable[str]) -> str:
        """``--predictor METHOD=DIR ...`` for the CLI (quoted shell words)."""
        return shell_args(*[w for m in methods for w in ("--predictor", f"{m}={self.predictor_dir(model, m)}")])

    @staticmethod
    def traces_arg(traces: str | list[str] | None) -> str:
        """``--traces DIR`` (quoted shell words), or nothing when the job reads no traces (online training)."""
        return shell_args("--traces", traces) if traces else ""

    def trace_dir(self, model: str, workload: str) -> str:
        """A whole trace set, gathered from its scatter shards."""
        return f"results/traces/{model}/{workload}"

    @property
    def trains_on_traces(self) -> bool:
        """Predictors learn from stored corpus traces (source: traces) or from the live model (source: online)."""
        return not trains_online(self.cfg)

    def train_inputs(self, model: str) -> dict[str, Any]:
        """What train_predictor reads: the corpus, the model, and the corpus traces unless training online."""
        inputs: dict[str, Any] = {"corpus": "results/corpus", "model": self.model_inputs(model)}
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
        return int(self.cfg["traces"].get("scatter", 1))

    def trace_shard_dirs(self, model: str, workload: str) -> list[str]:
        return [f"results/trace_shards/{model}/{workload}/{i}" for i in range(self.scatter)]

    def predictor_dir(self, model: str, method: str) -> str:
        return f"results/predictors/{model}/{method}"

    def is_learned(self, method: str) -> bool:
        return method in LEARNED_METHODS

    # ---------------------------------------------------------------- targets
    def recall_csvs(self) -> list[str]:
        return [f"results/recall/{m}/{w}/{i}.csv" for m in self.models for w in self.workloads
                for i in range(self.scatter)]

    def predictor_dirs(self) -> list[str]:
        return [self.predictor_dir(m, meth) for m in self.models for meth in self.methods]

    def paper_table_inputs(self) -> list[str]:
        return [
            "results/workloads/disjointness.json",
            "results/recall/recall.csv",
            "results/predictors/params.csv",
        ]

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
        "build_expert_store": {"cpu": {"mem_mb": 2000, "runtime": 20}, "paper": {"mem_mb": 128000, "runtime": 120}},
        "profile_window": {"cpu": {"mem_mb": 4000, "runtime": 30},
                           "paper": {"mem_mb": 128000, "runtime": 120, "gpu": 1}},
        "bench_runtime": {"cpu": {"mem_mb": 4000, "runtime": 120},
                          "paper": {"mem_mb": 128000, "runtime": 720, "gpu": 1}},
        "simulate_device": {"cpu": {"mem_mb": 4000, "runtime": 30}, "paper": {"mem_mb": 32000, "runtime": 120}},
        "validate_simulator": {"cpu": {"mem_mb": 4000, "runtime": 30}, "paper": {"mem_mb": 16000, "runtime": 60}},
        "evaluate_offloaded": {"cpu": {"mem_mb": 4000, "runtime": 60},
                               "paper": {"mem_mb": 128000, "runtime": 720, "gpu": 1}},
    }

    def resources(self, rule: str) -> dict[str, int]:
        kind = "paper" if self.cfg["profile"] == "paper" else "cpu"
        res = {"gpu": 0, **self._RESOURCES[rule][kind]}
        return res
