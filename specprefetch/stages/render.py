"""CLI: ``render-tables``, ``render-figures``, ``compare-paper``, ``write-numbers``, ``compile-preview``,
``diff-tables``, ``compare-verdicts``.

The Snakemake rules in workflow/rules/render.smk call exactly these; each also runs by hand, e.g.::

    specprefetch render-tables --config config/config.yaml --out-dir /tmp/tables
    specprefetch render-figures --config config/config.yaml --out-dir /tmp/tables/figures
    specprefetch compare-paper --config config/config.yaml --tables /tmp/tables/table*.json \\
        --figures /tmp/tables/figures/*.json --out-dir /tmp/tables
    specprefetch write-numbers --tables-dir /tmp/tables --out /tmp/tables/numbers.md
    specprefetch compile-preview --config config/config.yaml --dir /tmp/tables
    specprefetch diff-tables paper_tables /tmp/tables --config config/config.yaml
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from specprefetch.stages.common import add_config_arg, load_args_config

log = logging.getLogger(__name__)


def _input_names(inputs: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The result CSVs any of ``inputs`` (``TABLE_INPUTS`` or ``FIGURE_INPUTS``) reads, in RESULT_PATHS' order."""
    from specprefetch.render.targets import RESULT_PATHS

    return tuple(n for n in RESULT_PATHS if any(n in needs for needs in inputs.values()))


def _add_input_flags(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    from specprefetch.render.targets import RESULT_PATHS as DEFAULT_PATHS

    for name in names:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=Path, default=None,
                       help=f"the {name} CSV (default {DEFAULT_PATHS[name]}, or its file name in --results-dir)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="take every input not given by its own flag from this directory, by file name (e.g. the "
                        "archived inputs paper_tables/results)")


def _inputs(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Path]:
    from specprefetch.render.targets import RESULT_PATHS as DEFAULT_PATHS

    def default(name: str) -> Path:
        path = Path(DEFAULT_PATHS[name])
        return args.results_dir / path.name if args.results_dir is not None else path

    return {n: getattr(args, n) or default(n) for n in names}


def _cmd_archive(args: argparse.Namespace) -> None:
    from specprefetch.render.data import archive_inputs

    for path in archive_inputs(args.inputs, args.out_dir):
        print(f"{path}: archived")


def _cmd_render_tables(args: argparse.Namespace) -> None:
    from specprefetch.render.tables import TABLES, render_table

    cfg = load_args_config(args)
    names = args.table or list(TABLES)
    written: list[Path] = []
    try:
        for name in names:
            spec = TABLES[name]
            doc = render_table(name, cfg, _inputs(args, spec.inputs + spec.optional), args.out_dir / f"{name}.tex",
                               templates=args.templates)
            written += [args.out_dir / f"{name}.tex", args.out_dir / f"{name}.json"]
            print(f"{args.out_dir / name}.tex: {len(doc.cells)} cells")
    except BaseException:  # all tables or none: a full disk at table 3 leaves no tables 1-2 of this run behind
        for path in written:
            path.unlink(missing_ok=True)
        raise


def _cmd_render_figures(args: argparse.Namespace) -> None:
    from specprefetch.render.figures import FIGURES, render_figure
    from specprefetch.render.targets import figure_names

    cfg = load_args_config(args)
    for name in args.figure or figure_names(cfg):  # default: the figures the config renders (as the DAG's)
        doc = render_figure(name, cfg, _inputs(args, FIGURES[name].inputs + FIGURES[name].optional), args.out_dir)
        print(f"{args.out_dir / name}.{{pdf,png,json}}: {len(doc.cells)} values")


def _cmd_compare(args: argparse.Namespace) -> None:
    from specprefetch.render.compare import compare_with_paper
    from specprefetch.render.reported import load_reported

    cfg = load_args_config(args)
    if args.kept_runs is not None:
        cfg["render"]["kept_runs"] = [str(p) for p in args.kept_runs]
    claims = compare_with_paper(cfg, args.tables, args.figures or [], load_reported(args.reported), args.out_dir,
                                markdown=args.markdown, templates=args.templates, claims_file=args.claims)
    from specprefetch.render.compare import claim_counts

    n = claim_counts(claims)
    print(f"{args.out_dir}: {n['holds']} hold, {n['fails']} fail, {n['unresolved']} unresolved of {n['checkable']} "
          f"checkable claims of the paper ({cfg['profile']} profile); see comparison.md")


def _cmd_write_numbers(args: argparse.Namespace) -> None:
    from specprefetch.render.numbers import archive_sim_validation, write_numbers

    out_json = args.json or args.out.with_suffix(".json")
    sim = args.sim_validation
    if sim is not None and args.archive_dir is not None:  # cite the copy that is committed with the page
        sim = archive_sim_validation(sim, args.archive_dir)
        print(f"{sim}: archived")
    numbers = write_numbers(args.tables_dir, args.out, out_json, results_dir=args.results_dir,
                            comparison=args.comparison, sim_validation=sim, title=args.title)
    print(f"{args.out}, {out_json}: {len(numbers)} numbers")


def _cmd_compile_preview(args: argparse.Namespace) -> None:
    from specprefetch.render.preview import LatexMissing, compile_preview, write_preview_tex

    cfg = load_args_config(args)
    if args.pdf_only:
        tex = args.tex or args.dir / "paper_tables.tex"
    else:
        tex = write_preview_tex(cfg, args.dir, tables=args.table, figures=args.figure,
                                with_comparison=not args.no_comparison, target=args.tex, templates=args.templates)
        print(f"{tex}: written")
    if args.tex_only:
        return
    out = args.out or tex.with_suffix(".pdf")
    try:
        compile_preview(tex, out)
    except LatexMissing as exc:
        if args.skip_if_missing:
            print(f"compile-preview: {exc}", file=sys.stderr)
            return
        raise
    print(f"{out}: compiled")


def _cmd_diff(args: argparse.Namespace) -> None:
    from specprefetch.render.diff import Tolerances, diff_tables

    cfg = load_args_config(args) if args.config else None
    tol = Tolerances.from_sources(cfg, args.tolerances)
    report = diff_tables(args.old, args.new, tol, args.strict_verdicts)
    print(report.render())
    if report.failed:
        raise SystemExit(1)


def _cmd_compare_verdicts(args: argparse.Namespace) -> None:
    from specprefetch.render.diff import verdicts_across_runs

    report = verdicts_across_runs(args.renderings)
    print(report.render())
    if args.strict and report.disagreeing:
        raise SystemExit(1)


def register(sub: argparse._SubParsersAction) -> None:
    from specprefetch.render import diff
    from specprefetch.render.targets import FIGURE_INPUTS, TABLE_INPUTS
    from specprefetch.render.targets import FIGURE_NAMES as FIGURES
    from specprefetch.render.targets import TABLE_NAMES as TABLES

    p = sub.add_parser("render-tables", help="Tables 1-5 as LaTeX (+ a JSON of every cell) from the result CSVs")
    add_config_arg(p)
    p.add_argument("--table", action="append", choices=TABLES, help="only this table (repeatable)")
    _add_input_flags(p, _input_names(TABLE_INPUTS))
    p.add_argument("--out-dir", required=True, type=Path, help="writes <table>.tex and <table>.json here")
    p.add_argument("--templates", type=Path, default=None, help="jinja2 template directory (workflow/templates)")
    p.set_defaults(func=_cmd_render_tables)

    p = sub.add_parser("render-figures", help="Figures 1(a), 1(b), 4, 5, 6 and those beyond the paper (PDF, PNG, "
                                              "JSON)")
    add_config_arg(p)
    p.add_argument("--figure", action="append", choices=FIGURES,
                   help="only this figure (repeatable; default: every figure the config renders, fig_batch only "
                        "where a model runs the batch experiment)")
    _add_input_flags(p, _input_names(FIGURE_INPUTS))
    p.add_argument("--out-dir", required=True, type=Path, help="writes <figure>.{pdf,png,json} here")
    p.set_defaults(func=_cmd_render_figures)

    p = sub.add_parser("archive-results", help="copy the rendering inputs (result CSVs) beside the rendering, so "
                                               "the tables can be regenerated from them alone")
    p.add_argument("inputs", nargs="+", type=Path, help="result CSVs (checked to be readable tables)")
    p.add_argument("--out-dir", required=True, type=Path, help="e.g. paper_tables/results")
    p.set_defaults(func=_cmd_archive)

    p = sub.add_parser("compare-paper", help="reproduced vs the paper's reported numbers: *_vs_paper.tex, "
                                             "comparison.md, comparison.json")
    add_config_arg(p)
    p.add_argument("--tables", nargs="+", required=True, type=Path, help="table JSONs from render-tables")
    p.add_argument("--figures", nargs="*", type=Path, default=[], help="figure JSONs from render-figures")
    p.add_argument("--reported", type=Path, default=None, help="default config/reference/paper_reported.yaml")
    p.add_argument("--claims", type=Path, default=None, help="default config/reference/claims.yaml")
    p.add_argument("--kept-runs", nargs="*", type=Path, default=None,
                   help="earlier fresh runs' renderings (directories with comparison.json) to judge the device claims "
                        "across hours with (default: the config's render.kept_runs; none given: the run's own CIs)")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--markdown", type=Path, default=None, help="default <out-dir>/comparison.md")
    p.add_argument("--templates", type=Path, default=None)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("write-numbers", help="numbers.md and numbers.json: the measured numbers the docs cite, each "
                                             "with the file and cell it came from")
    p.add_argument("--tables-dir", required=True, type=Path,
                   help="the rendering: tableN_*.json, figures/*.json (e.g. paper_tables)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="the archived result CSVs, runs.csv and window.csv (default <tables-dir>/results)")
    p.add_argument("--comparison", type=Path, default=None, help="default <tables-dir>/comparison.json")
    p.add_argument("--sim-validation", type=Path, default=None,
                   help="the simulator's validation CSV (results/device/sim_validation.csv); optional")
    p.add_argument("--archive-dir", type=Path, default=None,
                   help="copy --sim-validation here first (e.g. paper_tables/results) and cite the copy")
    p.add_argument("--out", required=True, type=Path, help="the Markdown page, e.g. paper_tables/numbers.md")
    p.add_argument("--json", type=Path, default=None, help="the same records as JSON (default: --out with .json)")
    p.add_argument("--title", default="Measured numbers", help="the page's heading")
    p.set_defaults(func=_cmd_write_numbers)

    p = sub.add_parser("compile-preview", help="one LaTeX document with every table, comparison and figure; "
                                               "compiled with pdflatex when installed")
    add_config_arg(p)
    p.add_argument("--dir", required=True, type=Path, help="the rendered tables directory (e.g. paper_tables)")
    p.add_argument("--table", action="append", choices=TABLES, help="only these tables (default all)")
    p.add_argument("--figure", action="append", choices=FIGURES,
                   help="only these figures (default: every figure the config renders)")
    p.add_argument("--no-comparison", action="store_true", help="leave out the *_vs_paper tables")
    p.add_argument("--tex", type=Path, default=None, help="preview source (default <dir>/paper_tables.tex)")
    p.add_argument("--out", type=Path, default=None, help="PDF (default: the .tex with suffix .pdf)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tex-only", action="store_true", help="write the .tex, do not compile")
    mode.add_argument("--pdf-only", action="store_true", help="compile the existing .tex without rewriting it")
    p.add_argument("--skip-if-missing", action="store_true",
                   help="without pdflatex, say so and exit 0 instead of failing")
    p.add_argument("--templates", type=Path, default=None)
    p.set_defaults(func=_cmd_compile_preview)

    p = sub.add_parser("diff-tables", help="compare two renderings cell by cell; exit 1 past tolerance",
                       description=diff.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path, help="reference rendering: a directory (e.g. paper_tables) or a table JSON")
    p.add_argument("new", type=Path, help="new rendering: a directory or a table JSON")
    p.add_argument("--config", type=Path, default=None, help="profile YAML whose render.tolerances apply")
    p.add_argument("--tolerances", type=Path, default=None,
                   help="YAML with render.tolerances (or a bare tolerances mapping); overrides --config")
    p.add_argument("--strict-verdicts", action="store_true",
                   help="fail when a device claim's verdict differs between the two comparison.json (a rerun's "
                        "test: the same verdict for every device claim); without it they are listed as notes")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("compare-verdicts", help="every device claim's verdict in several renderings (fresh runs) and "
                                                "the verdict they support together")
    p.add_argument("renderings", nargs="+", type=Path,
                   help="two or more rendering directories with a comparison.json (e.g. paper_tables, another run's)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the runs disagree on any device claim")
    p.set_defaults(func=_cmd_compare_verdicts)
