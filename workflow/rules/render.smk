# Rendering (issue "paper_tables"): Tables 1-5 as LaTeX + a JSON of every cell, the figures (PDF, PNG, JSON),
# reproduced vs reported (config/reference/paper_reported.yaml), and the compiled preview PDF.
# Inputs are the result CSVs of the earlier stages, named per table/figure (specprefetch.render.targets): a table
# that needs results/device/runs.csv waits for the runtime stage (or fails as a missing input) instead of
# rendering an empty table. Outputs go to render.out_dir (default paper_tables/, committed for the embedded default).

from specprefetch.render import targets as RT

RENDER_DIR = RT.out_dir(P.cfg)
# The tables follow the config's order of models and workloads (the paper's), so the order is part of the hash.
RENDER_HASH = P.hash_of("models", "workloads", "recall", "predictors", "render") + "-" + P.order_hash()


wildcard_constraints:
    table=P.regex(RT.TABLE_NAMES),
    figure=P.regex(RT.FIGURE_NAMES),


localrules:
    render_table,
    render_figure,
    compare_with_paper,
    write_preview,
    compile_preview,
    archive_results,


rule archive_results:
    """The rendering inputs (result CSVs) copied beside the rendering, so the tables regenerate from them alone."""
    input:
        list(RT.RESULT_PATHS.values()),
    output:
        list(RT.archive_files(P.cfg).values()),
    params:
        out_dir=f"{RENDER_DIR}/{RT.ARCHIVE_SUBDIR}",
    log:
        "logs/archive_results/archive.log",
    benchmark:
        "benchmarks/archive_results/archive.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} archive-results --out-dir {params.out_dir:q} {input:q} 2>&1 | tee {log:q}"


rule render_table:
    """One of Tables 1-5 (workflow/templates/<table>.tex.j2) and its cells as JSON, for diff-tables."""
    input:
        unpack(lambda w: RT.table_inputs(w.table)),
    output:
        tex=report(
            f"{RENDER_DIR}/{{table}}.tex",
            caption="../report/table.rst",
            category="Tables",
            labels={"table": "{table}"},
        ),
        json=f"{RENDER_DIR}/{{table}}.json",
    params:
        cfg=RENDER_HASH,
        inputs=lambda w, input: RT.input_flags(dict(input.items())),  # quoted shell words
    log:
        "logs/render_table/{table}.log",
    benchmark:
        "benchmarks/render_table/{table}.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} render-tables --config {CFG:q} --table {wildcards.table:q} {params.inputs} "
        "--out-dir {RENDER_DIR:q} 2>&1 | tee {log:q}"


rule render_figure:
    """One figure with seaborn: PDF for LaTeX, PNG for viewing, JSON of the plotted numbers."""
    input:
        unpack(lambda w: RT.figure_inputs(w.figure)),
    output:
        pdf=f"{RENDER_DIR}/figures/{{figure}}.pdf",
        png=report(
            f"{RENDER_DIR}/figures/{{figure}}.png",
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
        json=f"{RENDER_DIR}/figures/{{figure}}.json",
    params:
        cfg=RENDER_HASH,
        inputs=lambda w, input: RT.input_flags(dict(input.items())),  # quoted shell words
    log:
        "logs/render_figure/{figure}.log",
    benchmark:
        "benchmarks/render_figure/{figure}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=5,
    shell:
        "export MPLBACKEND=Agg; "
        "{SP} render-figures --config {CFG:q} --figure {wildcards.figure:q} {params.inputs} "
        "--out-dir {RENDER_DIR:q}/figures 2>&1 | tee {log:q}"


rule compare_with_paper:
    """Reproduced vs reported for every table (<table>_vs_paper.tex), the paper's claims, comparison.md."""
    input:
        tables=expand(f"{RENDER_DIR}/{{table}}.json", table=RT.TABLE_NAMES),
        figures=expand(f"{RENDER_DIR}/figures/{{figure}}.json", figure=RT.FIGURE_NAMES),
        reported=str(P.workdir / RT.REPORTED),
    output:
        vs=expand(f"{RENDER_DIR}/{{table}}_vs_paper.tex", table=RT.TABLE_NAMES),
        figures_vs=f"{RENDER_DIR}/figures_vs_paper.tex",
        md=report(
            f"{RENDER_DIR}/comparison.md",
            caption="../report/comparison.rst",
            category="Comparison with the paper",
        ),
        json=f"{RENDER_DIR}/comparison.json",
    params:
        cfg=RENDER_HASH,
    log:
        "logs/compare_with_paper/compare.log",
    benchmark:
        "benchmarks/compare_with_paper/compare.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} compare-paper --config {CFG:q} --tables {input.tables:q} --figures {input.figures:q} "
        "--reported {input.reported:q} --out-dir {RENDER_DIR:q} 2>&1 | tee {log:q}"


rule write_preview:
    """The preview document (paper_tables.tex) that \\input's every table, comparison and figure."""
    input:
        tables=expand(f"{RENDER_DIR}/{{table}}.tex", table=RT.TABLE_NAMES),
        figures=expand(f"{RENDER_DIR}/figures/{{figure}}.{{ext}}", figure=RT.FIGURE_NAMES, ext=["pdf", "json"]),
        comparison=rules.compare_with_paper.output.vs,
        figures_vs=rules.compare_with_paper.output.figures_vs,
    output:
        f"{RENDER_DIR}/paper_tables.tex",
    log:
        "logs/write_preview/preview.log",
    benchmark:
        "benchmarks/write_preview/preview.tsv"
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    shell:
        "{SP} compile-preview --config {CFG:q} --dir {RENDER_DIR:q} --tex {output:q} --tex-only "
        "2>&1 | tee {log:q}"


rule compile_preview:
    """paper_tables.pdf with pdflatex (only in the DAG where pdflatex is installed: RT.preview_files)."""
    input:
        tex=f"{RENDER_DIR}/paper_tables.tex",
        parts=rules.write_preview.input,
    output:
        report(f"{RENDER_DIR}/paper_tables.pdf", caption="../report/preview.rst", category="Preview"),
    log:
        "logs/compile_preview/preview.log",
    benchmark:
        "benchmarks/compile_preview/preview.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "{SP} compile-preview --config {CFG:q} --dir {RENDER_DIR:q} --tex {input.tex:q} --out {output:q} "
        "--pdf-only 2>&1 | tee {log:q}"
