# Rendering (issue "paper_tables"): Tables 1-5 as LaTeX + a JSON of every cell, the figures (PDF, PNG, JSON),
# reproduced vs reported (config/reference/paper_reported.yaml), and the compiled preview PDF.
# Inputs are the result CSVs of the earlier stages, named per table/figure (specprefetch.render.targets): a table
# that needs results/device/runs.csv waits for the runtime stage (or fails as a missing input) instead of
# rendering an empty table. Outputs go to render.out_dir (default paper_tables/, committed for the embedded default);
# the CLI's --out-dir/--dir is derived from each rule's output.

from specprefetch.render import targets as RT


wildcard_constraints:
    table=P.regex(RT.TABLE_NAMES),
    figure=P.regex(RT.FIGURE_NAMES),


rule archive_results:
    """The rendering inputs (result CSVs) copied beside the rendering, so the tables regenerate from them alone."""
    input:
        list(RT.RESULT_PATHS.values()),
    output:
        list(RT.archive_files(P.cfg).values()),
    log:
        P.log_path("archive_results", "archive"),
    benchmark:
        P.benchmark_path("archive_results", "archive")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("archive_results"),
    params:
        cli=P.cli,
        out_dir=lambda w, output: P.parent_dir(output),  # <render.out_dir>/results
    shell:
        "{params.cli} archive-results --out-dir {params.out_dir:q} {input:q} 2>&1 | tee {log:q}"


rule render_table:
    """One of Tables 1-5 (workflow/templates/<table>.tex.j2) and its cells as JSON, for diff-tables."""
    input:
        unpack(lambda w: RT.table_inputs(w.table)),
    output:
        tex=report(
            RT.table_file(P.cfg, ext="tex"),
            caption="../report/table.rst",
            category="Tables",
            labels={"table": "{table}"},
        ),
        json=RT.table_file(P.cfg, ext="json"),
    log:
        P.log_path("render_table", "{table}"),
    benchmark:
        P.benchmark_path("render_table", "{table}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("render_table"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=P.render_hash(),
        inputs=lambda w, input: RT.input_flags(dict(input.items())),  # quoted shell words
        out_dir=lambda w, output: P.parent_dir(output.json),
    shell:
        "{params.cli} render-tables --config {params.config:q} --table {wildcards.table:q} {params.inputs} "
        "--out-dir {params.out_dir:q} 2>&1 | tee {log:q}"


rule render_figure:
    """One figure with seaborn: PDF for LaTeX, PNG for viewing, JSON of the plotted numbers."""
    input:
        unpack(lambda w: RT.figure_inputs(w.figure)),
    output:
        pdf=RT.figure_file(P.cfg, ext="pdf"),
        png=report(
            RT.figure_file(P.cfg, ext="png"),
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
        json=RT.figure_file(P.cfg, ext="json"),
    log:
        P.log_path("render_figure", "{figure}"),
    benchmark:
        P.benchmark_path("render_figure", "{figure}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("render_figure"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=P.render_hash(),
        inputs=lambda w, input: RT.input_flags(dict(input.items())),  # quoted shell words
        out_dir=lambda w, output: P.parent_dir(output.json),  # <render.out_dir>/figures
    shell:
        "export MPLBACKEND=Agg; "
        "{params.cli} render-figures --config {params.config:q} --figure {wildcards.figure:q} {params.inputs} "
        "--out-dir {params.out_dir:q} 2>&1 | tee {log:q}"


rule compare_with_paper:
    """Reproduced vs reported for every table (<table>_vs_paper.tex), the paper's claims, comparison.md."""
    input:
        tables=[RT.table_file(P.cfg, t, "json") for t in RT.TABLE_NAMES],
        figures=[RT.figure_file(P.cfg, f, "json") for f in RT.figure_names(P.cfg)],
        reported=str(P.workdir / RT.REPORTED),
        claims=str(P.workdir / RT.CLAIMS),
        kept=[str(P.workdir / run / "comparison.json") for run in P.cfg["render"]["kept_runs"]],
    output:
        vs=[RT.vs_paper_file(P.cfg, t) for t in RT.COMPARED_TABLES],
        figures_vs=RT.comparison_file(P.cfg, "figures_vs_paper.tex"),
        md=report(
            RT.comparison_file(P.cfg, "comparison.md"),
            caption="../report/comparison.rst",
            category="Comparison with the paper",
        ),
        json=RT.comparison_file(P.cfg, "comparison.json"),
    log:
        P.log_path("compare_with_paper", "compare"),
    benchmark:
        P.benchmark_path("compare_with_paper", "compare")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("compare_with_paper"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=P.render_hash(),
        out_dir=lambda w, output: P.parent_dir(output.json),
    shell:
        "{params.cli} compare-paper --config {params.config:q} --tables {input.tables:q} "
        "--figures {input.figures:q} --reported {input.reported:q} --claims {input.claims:q} "
        "--out-dir {params.out_dir:q} 2>&1 | tee {log:q}"


rule write_preview:
    """The preview document (paper_tables.tex) that \\input's every table, comparison and figure."""
    input:
        tables=[RT.table_file(P.cfg, t, "tex") for t in RT.TABLE_NAMES],
        figures=[RT.figure_file(P.cfg, f, ext) for f in RT.figure_names(P.cfg) for ext in ("pdf", "json")],
        comparison=rules.compare_with_paper.output.vs,
        figures_vs=rules.compare_with_paper.output.figures_vs,
    output:
        RT.preview_file(P.cfg, "tex"),
    log:
        P.log_path("write_preview", "preview"),
    benchmark:
        P.benchmark_path("write_preview", "preview")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("write_preview"),
    params:
        cli=P.cli,
        config=P.config_param,
        out_dir=lambda w, output: P.parent_dir(output),
    shell:
        "{params.cli} compile-preview --config {params.config:q} --dir {params.out_dir:q} --tex {output:q} "
        "--tex-only 2>&1 | tee {log:q}"


rule compile_preview:
    """paper_tables.pdf with pdflatex (only in the DAG where pdflatex is installed: RT.preview_files)."""
    input:
        tex=RT.preview_file(P.cfg, "tex"),
        parts=rules.write_preview.input,
    output:
        report(RT.preview_file(P.cfg, "pdf"), caption="../report/preview.rst", category="Preview"),
    log:
        P.log_path("compile_preview", "preview"),
    benchmark:
        P.benchmark_path("compile_preview", "preview")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("compile_preview"),
    params:
        cli=P.cli,
        config=P.config_param,
        out_dir=lambda w, output: P.parent_dir(output),
    shell:
        "{params.cli} compile-preview --config {params.config:q} --dir {params.out_dir:q} --tex {input.tex:q} "
        "--out {output:q} --pdf-only 2>&1 | tee {log:q}"


rule write_numbers:
    """numbers.md and numbers.json: the measured numbers the docs cite, each with the file and cell it came from."""
    input:
        tables=[RT.table_file(P.cfg, t, "json") for t in RT.TABLE_NAMES],
        figures=[RT.figure_file(P.cfg, f, "json") for f in RT.figure_names(P.cfg)],
        comparison=rules.compare_with_paper.output.json,
        archived=list(RT.archive_files(P.cfg).values()),
        sim_validation=P.sim_validation_table,
    output:
        md=P.numbers_file("md"),
        json=P.numbers_file("json"),
        sim_validation=P.numbers_file("sim_validation"),  # archived beside the other rendering inputs
    log:
        P.log_path("write_numbers", "numbers"),
    benchmark:
        P.benchmark_path("write_numbers", "numbers")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("write_numbers"),
    params:
        cli=P.cli,
        tables_dir=lambda w, input: P.parent_dir(input.tables),
        results_dir=lambda w, input: P.parent_dir(input.archived),
    shell:
        "{params.cli} write-numbers --tables-dir {params.tables_dir:q} --results-dir {params.results_dir:q} "
        "--comparison {input.comparison:q} --sim-validation {input.sim_validation:q} "
        "--archive-dir {params.results_dir:q} --out {output.md:q} --json {output.json:q} 2>&1 | tee {log:q}"
