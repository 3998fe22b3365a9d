"""Render docs/benchmarks/layer-models.md and layer-models.png from
benchmarks/results/h200/layer_models.json (and the tuner's cost from tune_decode.json), or with
`--gpu h100` layer-models-h100.md and .png from benchmarks/results/h100/: one
decoder layer's four FP8 projections per model,
added time over vLLM's quant + CUTLASS for the dispatcher (`epilora`), the dispatcher without a
launch table (`epilora-heuristic`) and vLLM's LoRA kernels (`vllm-default`), with each cell's
target (the kernels-library issue's) marked met or missed.

No number is typed by hand: every figure in the page comes from the result file.

    python tools/render_layer_models_docs.py [--gpu h100]
"""

import argparse
import json
from pathlib import Path

from layer_plots import plot_panels
from layer_rows import baseline_said, cutlass_baselines

ROOT = Path(__file__).parents[1]
GPUS = {"h200": "H200", "h100": "H100"}  # results folder -> the page's title; h200's is the issue's
MODELS = ("qwen3-8b", "llama3.1-8b", "qwen2.5-7b")
HEURISTIC_FACTOR = 1.5  # epilora-heuristic's added time at most this times epilora's
VLLM_FRACTION = 0.25  # beyond decode: our added time at most this fraction of vLLM's


def target(adapters: int, rank: int, tokens: int) -> tuple[str, float] | None:
    """The cell's target: ("added", limit) on epilora's added time, ("vllm", fraction) of
    vLLM's added time, or None where the issue sets none (several adapters at few tokens)."""
    if adapters == 1 and tokens <= 16:
        return ("added", 0.05 if rank == 64 else 0.10)
    if (adapters, rank) == (8, 16) and 8 <= tokens <= 32:
        return ("added", 0.15)
    if tokens >= 32:
        return ("vllm", VLLM_FRACTION)
    return None


def cells(rows: list[dict]) -> dict:
    """{model: {(adapters, rank): {tokens: {system: us}}}}, each with its case's cutlass."""
    cutlass = cutlass_baselines(rows)
    out: dict = {}
    for r in rows:
        if r["system"] == "cutlass":
            continue
        cell = out.setdefault(r["model"], {}).setdefault((r["adapters"], r["rank"]), {})
        cell = cell.setdefault(r["tokens"], {"cutlass": cutlass(r)})
        cell[r["system"]] = r["value"]
    return out


def verdicts(adapters: int, rank: int, tokens: int, c: dict) -> tuple[str, str]:
    """(the target's verdict, the heuristic's) for one cell."""
    added = {s: c[s] / c["cutlass"] - 1 for s in ("epilora", "epilora-heuristic",
                                                   "vllm-default")}
    goal = target(adapters, rank, tokens)
    if goal is None:
        verdict = "-"
    elif goal[0] == "added":
        verdict = f"{'met' if added['epilora'] <= goal[1] else 'MISSED'} (<= +{goal[1]:.0%})"
    else:
        ratio = added["epilora"] / added["vllm-default"]
        verdict = f"{'met' if ratio <= goal[1] else 'MISSED'} ({ratio:.2f} of vLLM's)"
    ours, heur = added["epilora"], added["epilora-heuristic"]
    heuristic = "met" if heur <= max(ours, 0) * HEURISTIC_FACTOR else "MISSED"
    return verdict, heuristic


def _buckets(data: dict) -> str:
    """The token buckets a tuner's result file timed, e.g. '1-32' or '1-32, one slot 1-64'."""
    spans: dict = {}
    for r in data["rows"]:
        if r["metric"] == "decode_us":
            spans.setdefault(r["adapters"] == 1, set()).add(r["tokens"])
    said = {one: f"{min(t)}-{max(t)}" for one, t in spans.items()}
    if len(set(said.values())) <= 1:
        return next(iter(said.values()), "none")
    return f"{said[False]}, one slot {said[True]}"


def _tuner_lines(tuner: Path, layer_used_cache: bool) -> list[str]:
    """The tuner's cost per model and what it found, from its own result file `tuner`;
    `layer_used_cache`: whether the layer run above had a tuner's cache."""
    if not tuner.exists():
        return []
    data = json.loads(tuner.read_text())
    meta = data["meta"]
    lines = ["## The tuner", ""]
    if not layer_used_cache:
        lines += ["The layer run above had no tuner's cache: the tuner's run below is "
                  "another call's, not what `epilora` used.", ""]
    lines += [f"From `{tuner.relative_to(ROOT)}`: commit `{meta['git_sha'][:10]}`, "
              f"{meta['date']}, `{meta['command']}`. `epilora_kernels.tuner.tune_decode` on "
              f"each model's four projections at the decode buckets ({_buckets(data)} "
              "tokens); seconds "
              "include compiling the candidates in parallel processes first (the "
              "first model's with Triton's disk cache empty). Before and after: the decode "
              "path per projection as the tuner timed it, before in the settings in use when "
              "the cell was tuned, which after the call's first model and setup include the "
              "picks the earlier ones cached for equal or near shapes (their after / before "
              "is nearer 1 than from scratch).", "",
              "| model | rank | slots | seconds | of which compiling | complete | cells | "
              "after / before (mean) | best |", "|---|---|---|---|---|---|---|---|---|"]
    cells: dict = {}
    for r in data["rows"]:
        if r["metric"] == "decode_us":
            run = (r["model"], r["rank"], r["adapters"])
            key = (r["projection"], r["tokens"])
            cells.setdefault(run, {}).setdefault(key, {})[r["system"]] = r["value"]
    for r in data["rows"]:
        if r["metric"] != "tune_s":
            continue
        run = (r["model"], r["rank"], r["adapters"])
        ratios = [c["tuner-after"] / c["tuner-before"] for c in cells.get(run, {}).values()
                  if "tuner-before" in c and "tuner-after" in c]
        mean = f"{sum(ratios) / len(ratios):.3f}" if ratios else "-"
        best = f"{min(ratios):.3f}" if ratios else "-"
        lines.append(f"| {r['model']} | {r['rank']} | {r['adapters']} | {r['value']:.1f} | "
                     f"{r['compile_s']:.1f} | "
                     f"{'yes' if r['complete'] else 'no'} | {len(ratios)} | {mean} | {best} |")
    return lines + [""]


def render(gpu: str) -> None:
    results = ROOT / "benchmarks/results" / gpu
    stem = "layer-models" if gpu == "h200" else f"layer-models-{gpu}"
    page, plot = ROOT / f"docs/benchmarks/{stem}.md", ROOT / f"docs/benchmarks/{stem}.png"
    source = results / "layer_models.json"
    data = json.loads(source.read_text())
    meta, table = data["meta"], cells(data["rows"])
    lines = [f"# Layer benchmark on three models' shapes ({GPUS[gpu]})", "",
             f"Generated by `tools/render_layer_models_docs.py` from "
             f"`{source.relative_to(ROOT)}`: commit `{meta['git_sha'][:10]}`, {meta['date']}, "
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, vLLM "
             f"{meta['vllm']}, launch table `{meta['launch_table'] or 'none recorded'}`; "
             f"`{meta['command']}`.", "",
             "One decoder layer's four FP8 projections (qkv, o, gate_up, down; per-token FP8 "
             "activations, per-tensor FP8 weights, random weights and adapters), each system's "
             "layer in one CUDA graph, graphs replayed in turns with the L2 flushed, medians. "
             "Added time is over `cutlass` (vLLM's quant + CUTLASS, no adapter; "
             f"{baseline_said(data['rows'])}). `epilora` is "
             "`epilora_kernels.lora_linear` with the shipped launch table (the H200's, which "
             "every sm_90 part without one of its own reads; tuned on Qwen3-8B's shapes; other "
             "shapes take their nearest tuned shape's entries within a factor of two)" +
             (f" overlaid by the tuner's cache of the same call (`{meta['launch_cache']}`"
              ")" if meta.get("launch_cache") else ", no tuner's cache") +
             "; `epilora-heuristic` the same with no table and no cache "
             "(EPILORA_LAUNCH_TABLES=0). In both, from commit f94436b on, K2's settings at "
             "1-32 tokens that were not tuned on the very shape are fitted to the GPU's waves "
             "(docs/kernels.md, \"Wave fitting\").", "",
             "Targets: one adapter at 1-16 tokens, rank 64 at most +5% and ranks 16/128 at "
             "most +10%; 8 adapters of rank 16 at 8-32 tokens at most +15%; every other cell "
             f"from 32 tokens at most {VLLM_FRACTION} of vLLM's added time; the heuristic at "
             f"most {HEURISTIC_FACTOR}x `epilora`'s added time everywhere. `-`: no target.", "",
             "## Summary", "", "| model | targets met | targets missed | heuristic met | "
             "heuristic missed |", "|---|---|---|---|---|"]
    body = []
    for model in MODELS:
        if model not in table:
            continue
        counts = {"met": 0, "MISSED": 0, "hmet": 0, "hMISSED": 0}
        body += [f"## {model}", "", "| setup | tokens | cutlass us | epilora us | epilora added "
                 "| heuristic added | vLLM added | target | heuristic <= 1.5x |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for (adapters, rank), by_tokens in sorted(table[model].items()):
            for tokens, c in sorted(by_tokens.items()):
                verdict, heuristic = verdicts(adapters, rank, tokens, c)
                if verdict != "-":
                    counts[verdict.split()[0]] += 1
                counts["h" + heuristic] += 1
                def add(system, c=c):
                    return f"{c[system] / c['cutlass'] - 1:+.1%}"

                body.append(f"| {adapters}x{rank} | {tokens} | {c['cutlass']:.1f} | "
                            f"{c['epilora']:.1f} | {add('epilora')} | "
                            f"{add('epilora-heuristic')} | {add('vllm-default')} | {verdict} | "
                            f"{heuristic} |")
        body.append("")
        lines.append(f"| {model} | {counts['met']} | {counts['MISSED']} | {counts['hmet']} | "
                     f"{counts['hMISSED']} |")
    lines += ["", f"![layer time, one rank-64 adapter]({plot.name})", "",
              *_tuner_lines(results / "tune_decode.json", bool(meta.get("launch_cache"))),
              *body]
    page.write_text("\n".join(lines) + "\n")
    panels = {model: {t: c for t, c in table[model][(1, 64)].items()}
              for model in MODELS if (1, 64) in table.get(model, {})}
    plot_panels(panels, ("cutlass", "vllm-default", "epilora", "epilora-heuristic"), plot)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                        help="the results folder under benchmarks/results/ (default h200)")
    render(parser.parse_args().gpu)
