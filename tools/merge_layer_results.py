"""Merge layer-benchmark result files from several device calls into one file.

A full `benchmarks/layer.py` run fits one device call, but a call that also runs the tests and
the decode benchmark may have to stop it early: the rest then runs with `--setups`. Each row
keeps its run's index (`run`), so a page compares systems within one run only (each run times
its own `cutlass`); `meta.runs` holds every run's meta. The runs must share the launch table
and, if their commits differ, the packages' sources (`git diff` between them, under
packages/, empty): only the benchmark scripts may differ. Otherwise `--note` must say why the
difference does not touch what the earlier runs measured (it goes into `meta.merge_note`).

    python tools/merge_layer_results.py OUT.json RUN1.json RUN2.json [...] [--note TEXT]
"""

import json
import subprocess
import sys

from epilora_testing.results import results_text


def merge(paths: list[str], note: str | None = None) -> dict:
    runs, rows = [], []
    for index, path in enumerate(paths):
        data = json.loads(open(path).read())
        runs.append(data["meta"])
        rows += [{**row, "run": index} for row in data["rows"]]
    if len({meta["launch_table"] for meta in runs}) != 1:
        raise SystemExit("the runs used different launch tables")
    for meta in runs[1:]:
        same = subprocess.run(["git", "diff", "--quiet", runs[0]["git_sha"], meta["git_sha"],
                               "--", "packages"])
        if same.returncode != 0 and not note:
            raise SystemExit(f"packages differ between {runs[0]['git_sha']} and "
                             f"{meta['git_sha']}; say why that is harmless with --note")
    merged_meta = {**runs[-1], "runs": runs}
    if note:
        merged_meta["merge_note"] = note
    return {"meta": merged_meta, "rows": rows}


if __name__ == "__main__":
    args = sys.argv[1:]
    note = None
    if "--note" in args:
        at = args.index("--note")
        note = args[at + 1]
        del args[at:at + 2]
    out, *paths = args
    merged = merge(paths, note)
    with open(out, "w") as f:
        f.write(results_text(merged["meta"], merged["rows"]))
