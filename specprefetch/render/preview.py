"""The compiled preview: one LaTeX document with every table, its comparison with the paper, and every figure.

``write_preview_tex`` writes ``paper_tables.tex`` next to the rendered files (it ``\\input``s them, so what compiles
here is exactly what a paper would paste); ``compile_preview`` runs ``pdflatex`` on it when LaTeX is installed and
otherwise raises ``LatexMissing`` with the packages to install. A LaTeX error is reported with the offending lines
of the log and the file, and leaves no PDF behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specprefetch.io import SpecPrefetchError, atomic_path, write_text_atomic
from specprefetch.render.cells import latex_escape, read_table_doc
from specprefetch.render.profile import profile_sentence
from specprefetch.render.tables import TABLES, render_template

log = logging.getLogger(__name__)
LATEX_PACKAGES = "texlive-latex-base texlive-latex-recommended texlive-latex-extra"


class LatexMissing(SpecPrefetchError):
    """pdflatex is not installed; the message says what to install."""


class LatexError(SpecPrefetchError):
    """pdflatex failed; the message carries the error lines of the log."""


def find_pdflatex() -> str | None:
    return shutil.which("pdflatex")


def missing_message(target: Path | str) -> str:
    return (f"pdflatex not found: skipping {target} (install it with `apt-get install -y --no-install-recommends "
            f"{LATEX_PACKAGES}` or your TeX distribution; the .tex tables are written regardless)")


def write_preview_tex(cfg: Mapping[str, Any], out_dir: Path | str, tables: Sequence[str] | None = None,
                      figures: Sequence[str] | None = None, with_comparison: bool = True,
                      target: Path | str | None = None, templates: Path | None = None) -> Path:
    """Write the preview document that inputs the rendered tables/figures found in ``out_dir``.

    Every listed table (``<name>.tex``), figure (``figures/<name>.pdf`` + its JSON caption) and, with
    ``with_comparison``, ``<name>_vs_paper.tex`` / ``figures_vs_paper.tex`` must exist: a missing one is an error
    naming it, so the preview never silently lacks a table.
    """
    from specprefetch.render.figures import FIGURES
    from specprefetch.render.targets import figure_names

    out_dir = Path(out_dir)
    tables = list(tables if tables is not None else TABLES)
    figures = list(figures if figures is not None else figure_names(cfg))  # the configured ones (as the DAG's)
    need = [out_dir / f"{t}.tex" for t in tables] + [out_dir / "figures" / f"{f}.pdf" for f in figures]
    if with_comparison:
        need += [out_dir / f"{t}_vs_paper.tex" for t in tables if TABLES[t].compared]
        need += [out_dir / "figures_vs_paper.tex"]
    absent = [str(p) for p in need if not p.is_file()]
    if absent:
        raise SpecPrefetchError(f"preview: missing rendered file(s) {', '.join(absent[:4])}"
                                f"{' ...' if len(absent) > 4 else ''} (run render-tables / render-figures / "
                                "compare-paper first)")
    fig_ctx = []
    for f in figures:
        meta_path = out_dir / "figures" / f"{f}.json"
        caption, where = FIGURES[f].caption, ""
        if meta_path.is_file():
            meta = read_table_doc(meta_path).meta
            caption = meta.get("caption", caption)
            if meta.get("note"):
                where += latex_escape(f" ({meta['note']}")
                where += latex_escape(f"; platform {meta['platform']}, model {meta.get('model', '?')})." if
                                      meta.get("platform") else ").")
        fig_ctx.append({"path": f"figures/{f}.pdf", "caption": caption + where, "label": f"fig:{f}", "name": f,
                        "paper_label": latex_escape(FIGURES[f].paper_label)})
    context = {
        "preamble": PREAMBLE,
        "title": f"SpecPrefetch reproduction: tables and figures ({latex_escape(cfg['profile'])} profile)",
        "profile": latex_escape(profile_sentence(cfg)),
        "tables": [{"name": t, "path": f"{t}.tex",
                    "vs": f"{t}_vs_paper.tex" if with_comparison and TABLES[t].compared else None} for t in tables],
        "figures": fig_ctx,
        "figures_vs": "figures_vs_paper.tex" if with_comparison else None,
    }
    target = Path(target) if target else out_dir / "paper_tables.tex"
    write_text_atomic(target, render_template("preview.tex.j2", context, templates))
    return target


def _latex_errors(log_text: str, limit: int = 12) -> str:
    lines = log_text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("!") or re.match(r".*:\d+: ", line):
            out += lines[i:i + 3]
            if len(out) >= limit:
                break
    return "\n".join(out[:limit]) or "\n".join(lines[-limit:])


def compile_preview(tex: Path | str, out_pdf: Path | str | None = None, pdflatex: str | None = None,
                    timeout_s: int = 300) -> Path:
    """Compile ``tex`` (in its own directory, so relative \\input paths resolve) to ``out_pdf`` atomically.

    Builds in a temporary directory and runs twice (captions and float placement settle); the PDF carries no
    timestamps (SOURCE_DATE_EPOCH), so the same inputs give the same bytes.
    """
    tex = Path(tex).resolve()
    out_pdf = Path(out_pdf) if out_pdf else tex.with_suffix(".pdf")
    exe = pdflatex or find_pdflatex()
    if exe is None:
        raise LatexMissing(missing_message(out_pdf))
    if not tex.is_file():
        raise SpecPrefetchError(f"{tex}: preview source not found")
    env = {**os.environ, "SOURCE_DATE_EPOCH": "0", "FORCE_SOURCE_DATE": "1"}
    with tempfile.TemporaryDirectory(prefix="specprefetch-latex-") as build:
        cmd = [exe, "-interaction=nonstopmode", "-halt-on-error", "-file-line-error", f"-output-directory={build}",
               tex.name]
        for _ in range(2):
            try:
                res = subprocess.run(cmd, cwd=tex.parent, env=env, capture_output=True, text=True,
                                     timeout=timeout_s, errors="replace")
            except subprocess.TimeoutExpired:
                raise LatexError(f"{tex}: pdflatex did not finish within {timeout_s} s") from None
            if res.returncode != 0:
                log_path = Path(build) / tex.with_suffix(".log").name
                text = log_path.read_text(errors="replace") if log_path.exists() else res.stdout
                raise LatexError(f"{tex}: pdflatex failed (exit {res.returncode}):\n{_latex_errors(text)}")
        built = Path(build) / tex.with_suffix(".pdf").name
        with atomic_path(out_pdf) as tmp:
            shutil.copyfile(built, tmp)
    log.info("compiled %s", out_pdf)
    return out_pdf


def compile_fragment(fragment: str, workdir: Path | str, pdflatex: str | None = None) -> Path:
    """Compile one table fragment in a minimal document (tests prove every table compiles on its own)."""
    workdir = Path(workdir)
    doc = (PREAMBLE + "\\begin{document}\n" + fragment + "\n\\end{document}\n")
    tex = workdir / "fragment.tex"
    tex.write_text(doc)
    return compile_preview(tex, workdir / "fragment.pdf", pdflatex)


PREAMBLE = r"""\documentclass[10pt]{article}
\usepackage[utf8]{inputenc}
\usepackage[margin=0.8in]{geometry}
\usepackage{amsmath,amssymb}
\usepackage{booktabs,multirow,array,graphicx}
\usepackage[font=small,labelfont=bf]{caption}
\ifdefined\pdftrailerid\pdftrailerid{}\fi
"""
