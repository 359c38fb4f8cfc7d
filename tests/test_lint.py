"""A lint-clean workflow (issue 14, item 4): `snakemake --lint`, snakefmt and ruff report nothing, and the Snakefile and
rule files keep the conventions they were cleaned up to (no private Snakemake API, one localrules directive, every path
and resource from specprefetch.workflow.Pipeline).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.test_workflow import ROOT, snakemake

SMK_FILES = [ROOT / "Snakefile", *sorted((ROOT / "workflow/rules").glob("*.smk"))]
PROFILES = ["config/config.yaml", "config/paper.yaml", "config/smoke.yaml"]


def lints(res: subprocess.CompletedProcess) -> list[str]:
    """Every lint of a `snakemake --lint json` run, as "<rule or file>: <title>"."""
    try:
        doc = json.loads(res.stdout)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        return [f"{item['for']}: {lint['title']}" for key in ("snakefiles", "rules") for item in doc.get(key) or []
                for lint in item["lints"]]
    # Snakemake 9.27's command line accepts `--lint json` but prints the text report (to stderr): "Lints for X:"
    # then one "    * <title>:" line per lint.
    found, where = [], "?"
    for line in (res.stdout + res.stderr).splitlines():
        if m := re.match(r"^Lints for (.+):$", line):
            where = m.group(1)
        elif m := re.match(r"^    \* (.+)$", line):
            found.append(f"{where}: {m.group(1)}")
    return found


def test_lint_parser_counts_lints() -> None:
    text = ("Lints for rule a (line 4, x.smk):\n    * Specify a conda environment or container for each rule.:\n"
            "      This way, ...\n    * Shell command directly uses variable SP from outside of the rule:\n")
    res = subprocess.CompletedProcess([], 1, stdout="", stderr=text)
    assert lints(res) == ["rule a (line 4, x.smk): Specify a conda environment or container for each rule.:",
                          "rule a (line 4, x.smk): Shell command directly uses variable SP from outside of the rule:"]
    doc = {"snakefiles": [], "rules": [{"for": {"rule": "a"}, "lints": [{"title": "T", "body": "", "links": []}]}]}
    assert lints(subprocess.CompletedProcess([], 1, stdout=json.dumps(doc), stderr="")) == ["{'rule': 'a'}: T"]


@pytest.mark.parametrize("profile", PROFILES)
def test_snakemake_lint_is_clean(tmp_path, profile: str) -> None:
    res = snakemake(tmp_path, "--lint", "json", "--configfile", str(ROOT / profile))
    found = lints(res)
    assert found == [], f"{len(found)} lint(s):\n" + "\n".join(found)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


def test_snakefmt_is_clean() -> None:
    if importlib.util.find_spec("snakefmt") is None:
        pytest.fail("snakefmt is not installed: pip install -e '.[test]'")
    # pyproject.toml's [tool.snakefmt] (line length 120) is read from the working directory
    res = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "--diff", "Snakefile", "workflow/rules/"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]


def test_ruff_is_clean() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "ruff" in pyproject.get("tool", {}), "pyproject.toml configures ruff ([tool.ruff])"
    if importlib.util.find_spec("ruff") is not None:
        cmd = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        cmd = [shutil.which("ruff")]
    else:
        pytest.fail("ruff is not installed (it is in the test extra: pip install -e '.[test]')")
    res = subprocess.run([*cmd, "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]


# ---------------------------------------------------------------- conventions of the Snakefile and the rule files
# The one use of a private Snakemake attribute, with its reason (Snakefile): Snakemake 9 has no public way to drop a
# rule's benchmark file, which it requires of a rule cached with --cache.
ALLOWED_PRIVATE = {("Snakefile", "workflow.get_rule(cached)._benchmark = None")}
PRIVATE = re.compile(r"\bworkflow\._|\._[A-Za-z]")


def code_lines(text: str) -> list[str]:
    """The lines of a Snakefile/.smk without comments (a `#` outside quotes starts one)."""
    out = []
    for line in text.splitlines():
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "\"'":
                quote = ch
            elif ch == "#":
                line = line[:i]
                break
        out.append(line.rstrip())
    return out


def private_uses(name: str, text: str) -> list[str]:
    return [f"{name}: {line.strip()}" for line in code_lines(text)
            if PRIVATE.search(line) and (name, line.strip()) not in ALLOWED_PRIVATE]


def test_no_private_snakemake_api() -> None:
    found = [use for smk in SMK_FILES for use in private_uses(smk.name, smk.read_text())]
    assert found == [], "\n".join(found)
    for name, line in ALLOWED_PRIVATE:  # the allow-list holds only what is still there
        assert line in (ROOT / name).read_text(), f"stale allow-list entry: {name}: {line}"


def test_private_check_catches_private_attributes() -> None:
    text = ('EXCLUSIVE_THREADS = workflow._cores or 1\n_rule._benchmark = None  # x\n'
            '# workflow._cores in a comment\nn = workflow.resource_settings.cores\ns = "a#b"  # workflow._x\n')
    assert private_uses("x.smk", text) == ["x.smk: EXCLUSIVE_THREADS = workflow._cores or 1",
                                           "x.smk: _rule._benchmark = None"]


def rules(text: str) -> list[tuple[str, str]]:
    return [(body.split(":")[0], body) for body in re.split(r"^rule ", text, flags=re.MULTILINE)[1:]]


def test_one_localrules_directive_in_the_snakefile() -> None:
    where = [smk.name for smk in SMK_FILES for line in smk.read_text().splitlines() if line.startswith("localrules:")]
    assert where == ["Snakefile"]


def test_paths_and_resources_come_from_the_pipeline() -> None:
    """No path literal under results/, logs/ or benchmarks/ in the rule files (they come from the Pipeline's path
    helpers), and every rule's resources are P.resources("<its name>")."""
    literal = re.compile(r"[\"'](results|logs|benchmarks)/")
    for smk in SMK_FILES:
        text = smk.read_text()
        found = [line.strip() for line in code_lines(text) if literal.search(line)]
        assert found == [], f"{smk.name}: {found}"
        for name, body in rules(text):
            if "\n    shell:" in body:
                assert f'    resources:\n        **P.resources("{name}"),\n' in body, f"{smk.name}: rule {name}"
