"""Every command in the README and the docs works as written (issue 13, item 5).

The ``snakemake …`` commands of README.md, ARCHITECTURE.md and the pages under docs/ (inline code spans, which may wrap
over a line break, and fenced blocks, ``$ `` prompts and ``&&`` chains included) are extracted, deduplicated by
their whitespace-normalised text and dry-run from the repository root with the venv's ``python -m snakemake -n``,
every other flag kept as written: a command that exits non-zero here is wrong in the docs (fix the docs, not this
test). Each one is also parsed by Snakemake's own argument parser, and every ``--forcerun`` value must be a rule and
every ``--configfile`` a file: both options take any number of values, so a target written after either is silently
read as one of them (after ``--forcerun`` Snakemake then runs the default target instead, exit 0).

What a dry run here cannot do as written is changed by the rules of ``SUBSTITUTIONS`` (each says why; every rule
must still apply to some documented command, so a stale one fails), and what cannot run at all goes in ``SKIP``
(which a test keeps small and whose entries must still be in the docs). Every ``specprefetch <subcommand>`` named in
the docs and in the package's docstrings must exist in ``specprefetch --help``, every documented ``specprefetch``
command without placeholders must parse, and ``specprefetch lm-eval`` (lm-eval's CLI with the offloaded model
registered) runs a real, tiny evaluation through lm-eval's own command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
# The hand-written docs: the README, the architecture, and every page under docs/ (by topic, issue 29)
DOCS = ("README.md", "ARCHITECTURE.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md")))
PLACEHOLDERS = ("…", "...", "<", ">")  # a command holding one of these is a pattern, not something to run

# Documented snakemake commands that are not run at all: normalised command -> why. Empty: every documented command
# runs here (with SUBSTITUTIONS). An entry must still be found in the docs, and the list must stay small.
SKIP: dict[str, str] = {}
MAX_SKIPPED = 3

# What is changed to dry-run a documented command here, keyed by the word of the command that triggers it.
SUBSTITUTIONS = {
    "--report": "dropped with its value (the rest is dry-run): a report is rendered from a finished run's outputs "
                "and writes report.html into the checkout; Snakemake's parser still reads the command as written",
    "--unlock": "`--directory <tmp>` added (with config/ linked into it: the embedded default's configfile is "
                "relative to the working directory): `-n` does not stop --unlock, and unlocking the checkout would "
                "drop the lock of a run in progress there",
    "/tmp/smoke": "replaced by a fresh temporary directory (a real smoke run may live in /tmp/smoke)",
    "bad.yaml": "a copy of config/config.yaml with top_k: 800 for tiny-qwen3-vl-moe, the invalid config of the "
                "README's transcript; the command must fail with that transcript",
}


# ------------------------------------------------------------------------------------------ extraction
_FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def _doc_text(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def code_pieces(text: str) -> list[tuple[str, list[str]]]:
    """(command-like text, documented output lines) of every fenced line and inline span, split at ``&&``."""
    out: list[tuple[str, list[str]]] = []
    for m in _FENCE.finditer(text):
        lines = m.group(2).splitlines()
        for i, line in enumerate(lines):
            prompt = line.startswith("$ ")
            transcript = []
            if prompt:  # what follows a `$ ` line up to the next prompt is its documented output
                for nxt in lines[i + 1:]:
                    if nxt.startswith("$ "):
                        break
                    transcript.append(nxt)
            for part in line.removeprefix("$ ").split("&&"):
                out.append((" ".join(part.split()), transcript))
    prose = _FENCE.sub("", text)
    for m in _SPAN.finditer(prose):
        if "\n\n" in m.group(2):  # a code span never crosses a paragraph
            continue
        for part in m.group(2).split("&&"):
            out.append((" ".join(part.split()), []))
    return out


def documented(program: str) -> dict[str, dict[str, Any]]:
    """Normalised ``program …`` commands of the docs -> {"docs": where found, "transcript": documented output}."""
    found: dict[str, dict[str, Any]] = {}
    for name in DOCS:
        for cmd, transcript in code_pieces(_doc_text(name)):
            if re.match(rf"{re.escape(program)}(\s|$)", cmd):
                entry = found.setdefault(cmd, {"docs": [], "transcript": []})
                entry["docs"].append(name)
                entry["transcript"] = entry["transcript"] or transcript
    return found


SNAKEMAKE_COMMANDS = documented("snakemake")
RUN = sorted(c for c in SNAKEMAKE_COMMANDS if c not in SKIP)


def _id(cmd: str) -> str:
    """A readable test id (pytest replaces strings over 100 characters by ``cmdN``)."""
    return cmd if len(cmd) <= 90 else cmd[:87] + "..."


def rule_names() -> set[str]:
    names = set()
    for f in [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]:
        names.update(re.findall(r"^(?:rule|checkpoint) (\w+):", f.read_text(), re.M))
    return names


# ------------------------------------------------------------------------------------------ snakemake commands
def test_the_docs_name_the_commands_we_expect() -> None:
    """The extractor works: the Quickstart's, the cluster section's and the reference's commands are found."""
    for cmd in ("snakemake --cores all paper_tables",
                "snakemake results/recall/recall.csv --workflow-profile profiles/slurm --configfile "
                "config/paper.yaml --forcerun gather_recall",
                "snakemake --cores all paper_tables --forcerun render_table render_figure",  # wraps a line
                "snakemake -n paper_tables --configfile bad.yaml"):  # a `$ ` prompt in a fenced block
        assert cmd in SNAKEMAKE_COMMANDS, cmd
    assert 10 <= len(SNAKEMAKE_COMMANDS) <= 30, sorted(SNAKEMAKE_COMMANDS)


def test_skip_list_is_small_and_current() -> None:
    assert len(SKIP) <= MAX_SKIPPED, "fix the docs or make the command runnable instead of skipping it"
    for cmd, why in SKIP.items():
        assert why.strip(), cmd
        assert cmd in SNAKEMAKE_COMMANDS, f"stale SKIP entry (no longer in {', '.join(DOCS)}): {cmd}"


def test_substitution_rules_are_current() -> None:
    for word in SUBSTITUTIONS:
        assert any(word in shlex.split(c) for c in RUN), f"stale substitution (no documented command has it): {word}"


def _bad_config(tmp_path: Path) -> Path:
    import yaml

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["models"]["tiny-qwen3-vl-moe"]["top_k"] = 800
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def prepared(cmd: str, tmp_path: Path) -> tuple[list[str], bool]:
    """The dry-run argv (after ``snakemake``) of a documented command, and whether it must succeed."""
    words = shlex.split(cmd)[1:]
    ok = True
    if "--report" in words:
        i = words.index("--report")
        del words[i:i + 2]
    if "--unlock" in words:
        (tmp_path / "unlock").mkdir()
        (tmp_path / "unlock" / "config").symlink_to(REPO / "config")
        words += ["--directory", str(tmp_path / "unlock")]
    words = [str(tmp_path / "smoke") if w == "/tmp/smoke" else w for w in words]
    if "bad.yaml" in words:
        words = [str(_bad_config(tmp_path)) if w == "bad.yaml" else w for w in words]
        ok = False
    if "-n" not in words and "--dry-run" not in words:
        words.insert(0, "-n")
    return words, ok


def _snakemake(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    # A documented `--cache` would write into SNAKEMAKE_OUTPUT_CACHE: point it at a temporary directory.
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "snakemake", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("cmd", RUN, ids=_id)
def test_documented_snakemake_command_parses(cmd: str) -> None:
    """Snakemake's own parser reads the command as written; forced rules are rules, config files are files."""
    from snakemake.cli import get_argument_parser

    args = get_argument_parser().parse_args(shlex.split(cmd)[1:])
    rules = rule_names()
    for rule in args.forcerun or []:
        assert rule in rules, (f"--forcerun {rule!r} is no rule (a target written after --forcerun is read as one "
                               f"of its values: put the targets first): {cmd}")
    for f in args.configfile or []:
        assert str(f) == "bad.yaml" or (REPO / f).is_file(), (f"--configfile {f} is no file (a target written after "
                                                               f"--configfile is read as a config file): {cmd}")
    if "--report" in cmd:
        assert args.report and args.targets, cmd


@pytest.mark.parametrize("cmd", RUN, ids=_id)
def test_documented_snakemake_command_dry_runs(cmd: str, tmp_path: Path) -> None:
    argv, ok = prepared(cmd, tmp_path)
    res = _snakemake(argv, tmp_path)
    out = res.stdout + res.stderr
    shown = f"snakemake {shlex.join(argv)} (documented: {cmd}; in {', '.join(SNAKEMAKE_COMMANDS[cmd]['docs'])})"
    if ok:
        assert res.returncode == 0, f"{shown} exited {res.returncode}:\n{out[-4000:]}"
        assert "This was a dry-run" in out or "--lint" in argv or "--unlock" in argv, out[-2000:]
        return
    assert res.returncode != 0, f"{shown} should fail (the docs show it failing):\n{out[-2000:]}"
    transcript = [t for t in SNAKEMAKE_COMMANDS[cmd]["transcript"] if t.strip()]
    assert transcript, f"no documented output for {cmd}"
    for line in transcript:
        assert re.search(_line_pattern(line), out), f"{shown}: documented {line!r} not in the output:\n{out[-2000:]}"


def _line_pattern(line: str) -> str:
    """A documented output line as a regex: ``…`` is the clone's directory, and a Snakefile line number moves
    with any edit above it (so any number matches)."""
    parts = re.split(r"(…|line \d+)", line)
    return "".join(".*" if p == "…" else r"line \d+" if re.fullmatch(r"line \d+", p) else re.escape(p) for p in parts)


# ------------------------------------------------------------------------------------------ specprefetch commands
def _subcommands() -> set[str]:
    from specprefetch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def _named_subcommands() -> dict[str, str]:
    """``specprefetch <subcommand>`` in the docs' code and the package's docstrings -> where."""
    named: dict[str, str] = {}
    for name in DOCS:
        for cmd, _ in code_pieces(_doc_text(name)):
            for m in re.finditer(r"(?:^|\s)specprefetch ([a-z][a-z0-9-]*)", cmd):
                named.setdefault(m.group(1), name)
    for f in sorted((REPO / "specprefetch").rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        for m in re.finditer(r"(?:`|^[ \t]+)specprefetch ([a-z][a-z0-9-]*)", text, re.M):
            named.setdefault(m.group(1), str(f.relative_to(REPO)))
    return named


def test_every_named_subcommand_exists() -> None:
    named, real = _named_subcommands(), _subcommands()
    assert {"extract-traces", "diff-tables", "lm-eval", "build-expert-store"} <= set(named), named
    missing = {n: where for n, where in named.items() if n not in real}
    assert not missing, f"subcommands named in the docs but not in `specprefetch --help`: {missing}"


def test_readme_lists_every_subcommand() -> None:
    m = re.search(r"`specprefetch --help` lists the subcommands \((.*?)\)", _doc_text("README.md"), re.S)
    assert m, "the README's list of subcommands is gone"
    listed = set(re.findall(r"`([a-z][a-z-]*)`", m.group(1)))
    assert listed == _subcommands(), {"not in the README": _subcommands() - listed,
                                      "not in the CLI": listed - _subcommands()}


# Full commands only: a bare `specprefetch gather-traces` in prose names the command (checked above), and a
# command with a placeholder (`…`, `...`, `<dir>`) is a pattern.
SPECPREFETCH_COMMANDS = sorted(c for c in documented("specprefetch")
                               if (len(c.split()) > 2 or c.split()[-1].startswith("-"))
                               and not any(p in c for p in PLACEHOLDERS))


@pytest.mark.parametrize("cmd", SPECPREFETCH_COMMANDS, ids=_id)
def test_documented_specprefetch_command_parses(cmd: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing only (the inputs of most are a finished run's outputs); ``--help`` exits 0."""
    from specprefetch.cli import build_parser

    try:
        args = build_parser().parse_args(shlex.split(cmd)[1:])
        if args.command == "lm-eval":  # the rest is lm-eval's: its own parser, and the model name must resolve
            from lm_eval._cli import HarnessCLI
            from lm_eval.api.registry import get_model

            import specprefetch.runtime.lm_eval_model  # noqa: F401  (registers specprefetch-offloaded)

            monkeypatch.setattr(sys, "argv", ["lm-eval", *args.lm_eval_args])  # HarnessCLI parses sys.argv
            lm_args = HarnessCLI().parse_args()
            model = get_model(lm_args.model)  # raises "no model for this name found" for an unknown one
            assert lm_args.model != "specprefetch-offloaded" or model.__name__ == "OffloadedLM", cmd
    except SystemExit as exc:  # --help
        assert exc.code == 0, f"{cmd}: {capsys.readouterr().err}"


def test_documented_lm_eval_commands_use_the_registering_entry_point() -> None:
    """No doc tells users to run a bare ``lm_eval --model specprefetch-offloaded`` (it cannot find the model)."""
    for name in (*DOCS, "specprefetch/runtime/lm_eval_model.py"):
        for line in _doc_text(name).splitlines():
            assert not re.match(r"\s*`*(lm_eval|lm-eval|python -m lm_eval) (run )?--model specprefetch", line), \
                f"{name}: {line.strip()} (use `specprefetch lm-eval ...`)"
    assert any(c.startswith("specprefetch lm-eval --model specprefetch-offloaded") for c in SPECPREFETCH_COMMANDS)


# ------------------------------------------------------------------------------------------ specprefetch lm-eval
def _specprefetch(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specprefetch", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def test_lm_eval_help_is_lm_evals() -> None:
    res = _specprefetch("lm-eval", "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Language Model Evaluation Harness" in res.stdout and "run" in res.stdout


@pytest.fixture(scope="module")
def offloaded_artefacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The smoke profile's DeepSeek-VL2 stand-in (untrained), its expert store and a local 3-sample lm-eval task."""
    import torch
    from transformers import AutoTokenizer

    from specprefetch.config import load_config
    from specprefetch.data.lm_eval_tasks import write_lm_eval_task
    from specprefetch.models import load_bundle
    from specprefetch.models.standins import build_stand_in, save_stand_in
    from specprefetch.runtime.core.store import build_expert_store
    from tests.conftest import build_tokenizer, write_tiny_workload

    root = tmp_path_factory.mktemp("lm_eval_cli")
    name = "tiny-deepseek-vl2"
    cfg = load_config(REPO / "config" / "smoke.yaml")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(build_tokenizer(root / "tokenizer"))
        save_stand_in(build_stand_in(cfg, name, tok), root / "model")
        bundle = load_bundle(cfg, name, root / "model")
        build_expert_store(bundle.model, root / "store", bundle.routing, model_name=name)
    finally:
        torch.set_num_threads(before)
    wdir = write_tiny_workload(root / "workloads" / "gsm8k", 3, cfg["image"]["size"], seed=4, split="test",
                               benchmark="gsm8k")
    write_lm_eval_task(wdir, "tiny_gsm8k")
    return {"root": root, "model": root / "model", "store": root / "store", "tasks": wdir / "lm_eval"}


def test_lm_eval_runs_specprefetch_offloaded(offloaded_artefacts: dict[str, Path]) -> None:
    """A real tiny evaluation through lm-eval's own CLI, the model served by the offloaded runtime (FATE prefetch)."""
    a = offloaded_artefacts
    out = a["root"] / "results"
    model_args = (f"config={REPO / 'config' / 'smoke.yaml'},model=tiny-deepseek-vl2,model_dir={a['model']},"
                  f"store={a['store']},policy=fate,m_max=2")
    res = _specprefetch("lm-eval", "--model", "specprefetch-offloaded", "--model_args", model_args, "--device", "cpu",
                        "--tasks", "tiny_gsm8k", "--include_path", str(a["tasks"]), "--limit", "2",
                        "--gen_kwargs", "max_gen_toks=4", "--output_path", str(out), "--log_samples",
                        cwd=a["root"])
    log = res.stdout + res.stderr
    assert "no model for this name found" not in log, log[-3000:]
    assert res.returncode == 0, log[-3000:]
    results = sorted(out.rglob("results_*.json"))
    assert len(results) == 1, sorted(out.rglob("*"))
    doc = json.loads(results[0].read_text())
    assert doc["config"]["model"] == "specprefetch-offloaded"
    assert "exact_match,none" in doc["results"]["tiny_gsm8k"]
    samples = sorted(out.rglob("samples_tiny_gsm8k_*.jsonl"))
    assert len(samples) == 1 and len(samples[0].read_text().splitlines()) == 2
