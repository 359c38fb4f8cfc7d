"""Per-rule times of a Snakemake run, from the `benchmark:` files every rule writes.

    python scripts/rule_times.py [WORKDIR]        # default: the current directory

Prints, per rule, the number of jobs, the summed and the longest job wall time (s), the summed CPU time and the
largest resident memory, as Markdown, then the wall time of the newest Snakemake log (start to the last
"Finished" line) when there is one. Sums over jobs exceed the wall time where jobs ran in parallel.
"""

from __future__ import annotations

import re
import sys
from datetime import datetime
from pathlib import Path

import pandas as pd


def rule_times(workdir: Path) -> pd.DataFrame:
    rows = []
    for tsv in sorted((workdir / "benchmarks").rglob("*.tsv")):
        rule = tsv.relative_to(workdir / "benchmarks").parts[0]
        df = pd.read_csv(tsv, sep="\t")
        for r in df.itertuples():
            rows.append({"rule": rule, "s": float(r.s), "cpu_s": float(r.cpu_time), "max_rss_mb": float(r.max_rss)})
    if not rows:
        raise SystemExit(f"{workdir / 'benchmarks'}: no benchmark files")
    df = pd.DataFrame(rows)
    out = df.groupby("rule", sort=False).agg(jobs=("s", "size"), sum_s=("s", "sum"), max_s=("s", "max"),
                                             cpu_s=("cpu_s", "sum"), max_rss_mb=("max_rss_mb", "max"))
    return out.sort_values("sum_s", ascending=False)


def wall_time(workdir: Path) -> float | None:
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        return None
    stamps = re.findall(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]", logs[-1].read_text(), re.M)
    if len(stamps) < 2:
        return None
    t = [datetime.strptime(re.sub(" +", " ", s), "%a %b %d %H:%M:%S %Y") for s in (stamps[0], stamps[-1])]
    return (t[1] - t[0]).total_seconds()


def main() -> None:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    df = rule_times(workdir)
    print("| rule | jobs | sum (s) | longest job (s) | CPU (s) | max RSS (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for rule, r in df.iterrows():
        print(f"| {rule} | {int(r.jobs)} | {r.sum_s:.1f} | {r.max_s:.1f} | {r.cpu_s:.1f} | {r.max_rss_mb:.0f} |")
    print(f"| **all** | {int(df.jobs.sum())} | {df.sum_s.sum():.1f} | | {df.cpu_s.sum():.1f} | |")
    wall = wall_time(workdir)
    if wall is not None:
        print(f"\nWall time of the newest Snakemake run: {wall:.0f} s ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()
