"""benchmarks/layer.py's rows as the layer pages read them: each cell's `cutlass` baseline.

Since 2026-12-07 layer.py times the no-adapter systems in every case and marks each row with
its case's `setup` ("1x64"), so each cell has the baseline replayed in turns beside it; files
from before have cutlass in the first setup's cases only, which then serves every setup. A
merged file (tools/merge_layer_results.py) numbers its runs (`run`): a cell's baseline is its
own run's.
"""


def _case(row: dict, setup) -> tuple:
    return row.get("run", 0), row.get("model"), setup, row["tokens"]


def cutlass_baselines(rows: list[dict]):
    """A function of a row: the `cutlass` median of its case (or, in older files, of its run's
    model and token count)."""
    base = {_case(r, r.get("setup")): r["value"] for r in rows if r["system"] == "cutlass"}
    return lambda row: base[_case(row, row.get("setup"))]


def baseline_said(rows: list[dict]) -> str:
    """How the page's cells met their baseline, for the page's text."""
    if all("setup" in r for r in rows if r["system"] == "cutlass"):
        return "each cell's `cutlass` replayed in turns with its own case's systems"
    return ("`cutlass` replayed in turns only in the first setup's cases (the file predates "
            "benchmarks/layer.py timing it in every case): the other setups' cells are over a "
            "baseline timed in an earlier case, so drift between cases reaches their ratios")
