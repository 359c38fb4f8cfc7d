"""Config strings never reach a job's shell as shell syntax (issue 15, item 2).

Two lines of defence: path-like config keys must match a pattern with no shell metacharacters (the schema), and every
placeholder in a rule's ``shell:`` string is quoted (``:q``) or is a value built with ``shlex`` (an allow-list).
"""

from __future__ import annotations

import ast
import copy
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specprefetch.config import ConfigError, validate_config
from tests.test_workflow import ROOT, snakemake

SMK_FILES = [ROOT / "Snakefile", *sorted((ROOT / "workflow/rules").glob("*.smk"))]

# Placeholders a `shell:` string may use without :q, because their value is already shell words (each argument quoted
# with shlex where it is built); the value is the regex its definition must match, so the allow-list cannot be reused
# for a param built some other way.
PRE_QUOTED = {
    # the CLI, "PYTHON -m specprefetch": Pipeline.cli (Pipeline.cli_words, shell_args)
    "params.cli": r"^P\.cli,?$",
    # "--model-dir DIR" or nothing: Pipeline.model_dir_arg (shell_args)
    "params.model_dir": r"P\.model_dir_arg\(",
    # "--predictor METHOD=DIR ...": Pipeline.predictor_args (directly or through Pipeline.device_predictor_args)
    "params.predictors": r"P\.(device_)?predictor_args\(",
    # "--recall FILE --runs FILE ...": render.targets.input_flags (shlex.join)
    "params.inputs": r"RT\.input_flags\(",
    # "--traces DIR" or nothing: Pipeline.traces_arg (shell_args)
    "params.traces": r"P\.traces_arg\(",
    # how train_predictor starts: Pipeline.train_command; the interpreter is quoted, predictors.training.launcher is a
    # command by design (a trusted launcher prefix such as torchrun, inserted as shell words)
    "params.run": r"P\.train_command\(",
    # "--variant NAME" or nothing: Pipeline.variant_arg (shell_args)
    "params.variant": r"P\.variant_arg\(",
}


def shell_blocks(text: str) -> list[tuple[str, str, str]]:
    """(rule name, rule body, shell string) for every rule of a Snakefile/.smk: the string literals after ``shell:``."""
    out = []
    for body in re.split(r"^rule ", text, flags=re.MULTILINE)[1:]:
        name = body.split(":")[0].strip()
        m = re.search(r"^    shell:\n((?:        [\"'].*\n?)+)", body, flags=re.MULTILINE)
        if m:
            out.append((name, body, "".join(ast.literal_eval(line.strip()) for line in m.group(1).splitlines())))
        else:
            assert "\n    shell:" not in body, f"rule {name}: a shell: block this test cannot parse"
    return out


def unquoted_placeholders(text: str, used: set[str] | None = None) -> list[str]:
    """Every placeholder of every rule's shell string that is neither :q-quoted nor a justified pre-quoted value."""
    problems = []
    for rule, body, cmd in shell_blocks(text):
        for _, field, spec, _ in string.Formatter().parse(cmd):
            if field is None:
                continue
            if field in PRE_QUOTED:
                if used is not None:
                    used.add(field)
                if spec:
                    problems.append(f"rule {rule}: {{{field}}} is already shell words; do not :q it")
                elif field.startswith("params."):
                    params = re.search(r"^    params:\n((?:        .*\n)+)", body, flags=re.MULTILINE)
                    definition = params and re.search(rf"^        {field.split('.', 1)[1]}=(.*)$", params.group(1),
                                                      flags=re.MULTILINE)
                    if not (definition and re.search(PRE_QUOTED[field], definition.group(1))):
                        problems.append(f"rule {rule}: {{{field}}} must be built by {PRE_QUOTED[field]}")
            elif not spec.endswith("q"):
                problems.append(f"rule {rule}: {{{field}}} reaches the shell unquoted: use {{{field}:q}}")
    return problems


def test_every_shell_placeholder_is_quoted_or_pre_quoted() -> None:
    used: set[str] = set()
    n_rules = 0
    for smk in SMK_FILES:
        text = smk.read_text()
        n_rules += len(shell_blocks(text))
        assert unquoted_placeholders(text, used) == [], smk.name
    assert n_rules >= 20  # the parser found the rules' commands (every rule has one but paper_tables)
    assert used == set(PRE_QUOTED), f"allow-list entries no rule uses: {set(PRE_QUOTED) - used}"


def test_static_check_catches_an_unquoted_placeholder() -> None:
    rule = ('rule foo_bar:\n    input:\n        model_dir=lambda w: P.model_dir_arg(w.model),\n'
            '    params:\n        cli=P.cli,\n        model_dir=lambda w: f"--model-dir {{w.model}}",\n'
            '        out_dir=lambda w, output: P.parent_dir(output),\n    shell:\n'
            '        "{params.cli} x --out {output:q} {params.model_dir} {params.out_dir} "\n'
            '        "--dir {RENDER_DIR} {input.x:q} {log}"\n')
    assert unquoted_placeholders(rule) == [
        "rule foo_bar: {params.model_dir} must be built by " + PRE_QUOTED["params.model_dir"],
        "rule foo_bar: {params.out_dir} reaches the shell unquoted: use {params.out_dir:q}",
        "rule foo_bar: {RENDER_DIR} reaches the shell unquoted: use {RENDER_DIR:q}",
        "rule foo_bar: {log} reaches the shell unquoted: use {log:q}",
    ]
    requoted = unquoted_placeholders(rule.replace("{params.cli}", "{params.cli:q}"))
    assert requoted[0] == "rule foo_bar: {params.cli} is already shell words; do not :q it"
    # a pre-quoted name whose param is built some other way
    other_cli = unquoted_placeholders(rule.replace("cli=P.cli,", 'cli="python -m specprefetch",'))
    assert other_cli[0] == "rule foo_bar: {params.cli} must be built by " + PRE_QUOTED["params.cli"]


# ---------------------------------------------------------------- the schema's pattern for path-like keys
@pytest.fixture(scope="module")
def default_cfg() -> dict:
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())


def _set(cfg: dict, path: list, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    for p in path[:-1]:
        node = node.setdefault(p, {}) if isinstance(node, dict) else node[p]
    node[path[-1]] = value
    return cfg


MODEL = "tiny-qwen3-vl-moe"
PATH_KEYS = [
    (["render", "out_dir"], "render.out_dir"),
    (["device", "external_logs"], "device.external_logs.0"),
    (["models", MODEL, "path"], f"models.{MODEL}.path"),
    (["workloads", "gsm8k", "path"], "workloads.gsm8k.path"),
    (["workloads", "gsm8k", "dataset"], "workloads.gsm8k.dataset.path"),
    (["predictors", "training", "deepspeed_config"], "predictors.training.deepspeed_config"),
]
EVIL = ["x; touch PWNED", "$(touch PWNED)", "`touch PWNED`", "a'b", 'a"b', "a\nb", "a\tb", "a|b", "a&b", "a>b",
        "a*", "~/x", "a\\b", "-rf", ""]


@pytest.mark.parametrize("value", EVIL, ids=repr)
@pytest.mark.parametrize(("path", "key"), PATH_KEYS, ids=[k for _, k in PATH_KEYS])
def test_path_keys_reject_shell_syntax(default_cfg: dict, path: list, key: str, value: str) -> None:
    if key.endswith("external_logs.0"):
        value = [value]
    elif key.endswith("dataset.path"):
        value = {"path": value, "split": "test"}
    with pytest.raises(ConfigError) as info:
        validate_config(_set(default_cfg, path, value), ROOT)
    msg = str(info.value)
    assert f"'{key}'" in msg and "\n" not in msg, msg
    assert "does not match" in msg or "non-empty" in msg or "too short" in msg, msg  # the schema, not "file not found"


@pytest.mark.parametrize("value", ["my tables/out dir", "results/paper_tables", "/abs/a-b_c.d/e+f=g@h,i:j"])
def test_ordinary_paths_pass(default_cfg: dict, value: str) -> None:
    validate_config(_set(default_cfg, ["render", "out_dir"], value), ROOT)


@pytest.mark.parametrize("profile", sorted(p.name for p in (ROOT / "config").glob("*.yaml")))
def test_shipped_configs_still_validate(profile: str) -> None:
    res = subprocess.run([sys.executable, "-m", "specprefetch", "validate-config", "--config", f"config/{profile}"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr


def _write_cfg(tmp_path: Path, out_dir: str, **device) -> Path:
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg["render"]["out_dir"] = out_dir
    cfg["device"].update(device)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


INJECTED = "x; touch PWNED"


def test_validate_config_rejects_injected_out_dir(tmp_path: Path) -> None:
    bad = _write_cfg(tmp_path, INJECTED)
    res = subprocess.run([sys.executable, "-m", "specprefetch", "validate-config", "--config", str(bad)],
                         capture_output=True, text=True, cwd=tmp_path, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "render.out_dir" in lines[0], res.stderr
    assert not (tmp_path / "PWNED").exists()


def test_snakemake_rejects_injected_out_dir(tmp_path: Path) -> None:
    bad = _write_cfg(tmp_path, INJECTED)
    res = snakemake(tmp_path, "-n", "-p", "--cores", "1", "paper_tables", "--configfile", str(bad))
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "render.out_dir" in out and "Shell command" not in out, out[-3000:]
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- the printed commands of a dry run
def shell_commands(output: str) -> list[str]:
    return re.findall(r"^Shell command: (.*)$", output, flags=re.MULTILINE)


def test_dry_run_quotes_a_path_with_a_space(tmp_path: Path) -> None:
    out_dir = "my tables/out dir"
    external = str(tmp_path / "ext logs" / "phone run.csv")  # device.external_logs: collect_device_benchmarks reads it
    Path(external).parent.mkdir()
    Path(external).write_text("")
    cfg = _write_cfg(tmp_path, out_dir, external_logs=[external])
    res = snakemake(tmp_path, "-n", "-p", "--cores", "1", "paper_tables", "--configfile", str(cfg))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    commands = shell_commands(res.stdout)
    assert len(commands) > 50, out[-3000:]
    for cmd in commands:
        shlex.split(cmd)  # every printed command is well-formed shell (balanced quotes)
    tables = [c for c in commands if " render-tables " in c]
    assert len(tables) == 6, tables  # Tables 0 (stand-in realism) to 5
    for cmd in tables:
        assert f"--out-dir {shlex.quote(out_dir)} " in cmd, cmd
        words = shlex.split(cmd)
        i = words.index("--out-dir")
        assert words[i + 1] == out_dir, words
        assert words[i + 2:i + 3] == ["2>&1"], words  # the directory is one argument: nothing else follows it
    # every other rule that writes under render.out_dir gets it as one argument too
    for flag, tool, want in (("--out-dir", "render-figures", f"{out_dir}/figures"),
                             ("--out-dir", "archive-results", f"{out_dir}/results"),
                             ("--out-dir", "compare-paper", out_dir), ("--dir", "compile-preview", out_dir)):
        cmds = [shlex.split(c) for c in commands if f" {tool} " in c]
        assert cmds, tool
        for words in cmds:
            assert words[words.index(flag) + 1] == want, words
    [collect] = [shlex.split(c) for c in commands if " collect-device-benchmarks " in c]
    i = collect.index("--external")
    assert collect[i + 1] == external and collect[i + 2] == "--windows", collect


# ---------------------------------------------------------------- the pre-quoted params
def test_pre_quoted_params_are_quoted_shell_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  default_cfg: dict) -> None:
    from specprefetch.render import targets
    from specprefetch.workflow import Pipeline, shell_args

    monkeypatch.chdir(tmp_path)  # Pipeline writes the resolved config under .snakemake/
    model_dir = tmp_path / "my model"
    model_dir.mkdir()
    cfg = _set(default_cfg, ["models", MODEL, "source"], "local")
    cfg["models"][MODEL]["path"] = str(model_dir)
    cfg["models"][MODEL].pop("pretrain", None)
    p = Pipeline(cfg, workdir=ROOT, python="/opt/my python/bin/python")
    assert shlex.split(p.cli_words) == ["/opt/my python/bin/python", "-m", "specprefetch"]
    assert p.cli(None, input=[]) == p.cli_words  # the rules' `cli` param (a function of the job's input: untracked)
    assert shlex.split(p.model_dir_arg(MODEL)) == ["--model-dir", str(model_dir)]
    assert shlex.split(p.predictor_args(MODEL, ["fate", "oracle"])) == [
        "--predictor", f"fate=results/predictors/{MODEL}/fate",
        "--predictor", f"oracle=results/predictors/{MODEL}/oracle"]
    assert shlex.split(p.traces_arg("a b/c")) == ["--traces", "a b/c"] and p.traces_arg(None) == ""
    assert shlex.split(p.variant_arg("@my;variant")) == ["--variant", "my;variant"] and p.variant_arg("") == ""
    assert shlex.split(p.train_command("/opt/my python/bin/python")) == ["/opt/my python/bin/python", "-m",
                                                                          "specprefetch"]
    assert shlex.split(shell_args("a;b", ["c d", "e"], 3)) == ["a;b", "c d", "e", "3"]
    assert shlex.split(targets.input_flags({"window_events": "w e.csv", "runs": "r;x.csv"})) == [
        "--window-events", "w e.csv", "--runs", "r;x.csv"]


def test_launcher_stays_a_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_cfg: dict) -> None:
    """predictors.training.launcher is a launcher prefix by design: its words are kept as shell words."""
    from specprefetch.workflow import Pipeline

    monkeypatch.chdir(tmp_path)
    cfg = _set(default_cfg, ["predictors", "training", "launcher"], "torchrun --standalone --nproc_per_node=4")
    assert shlex.split(Pipeline(cfg, workdir=ROOT).train_command(sys.executable)) == [
        "torchrun", "--standalone", "--nproc_per_node=4", "-m", "specprefetch"]
