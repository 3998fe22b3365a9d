"""Render docs/benchmarks/serving.md from benchmarks/results/h200/serving.json (if it exists):
each model's systems side by side per scenario, with the plugin issue's targets, judged only
where both rows come from one run (one commit's logs: side by side on one machine).

    python tools/render_serving_docs.py
"""

import json
from pathlib import Path

ROOT = Path(__file__).parents[1]
SOURCE = ROOT / "benchmarks/results/h200/serving.json"
PAGE = ROOT / "docs/benchmarks/serving.md"
SYSTEMS = ("epilora", "vllm-default", "vllm-dual-stream", "no-lora")
STOCK_LORA = ("vllm-default", "vllm-dual-stream")
# The plugin issue's targets, against stock without LoRA and stock's fastest LoRA configuration
# measured in the same run: batch-1 TPOT at most these multiples; 32 tenants' throughput at
# least these.
TARGETS = {"tpot1": ("tpot_ms", "lower", 1.05, 0.72),
           "tenants32": ("output_tokens_per_s", "higher", 0.97, 1.07)}
# Online: median TPOT at most this multiple of stock's, p99 TTFT at most this, at every rate.
ONLINE_TPOT, ONLINE_TTFT = 0.85, 1.1
# Starts (the `start` scenario, each system on caches of its own): the first, with them empty,
# at most this many seconds over stock's; a later one at most LATER_START_S over stock's later.
FIRST_START_S, LATER_START_S = 90, 10
SCENARIO_TITLES = {
    "online": "online: `vllm serve`, 32 tenants, Poisson arrivals",
    "tpot1": "batch 1, one rank-64 adapter",
    "tenants32": "32 tenants: 256 requests of 512 prompt and 256 output tokens at once",
    "start": "start: the 32 tenants' engine, first with empty caches, then again"}
# Each scenario's columns: (metric, heading, format).
COLUMNS = {
    "tpot1": [("tpot_ms", "TPOT, ms", ".3f"),
              ("tpot_ms_base_request", "base request, ms", ".3f")],
    "tenants32": [("output_tokens_per_s", "output tokens/s", ",.0f"),
                  ("output_tokens_per_s", "runs", "samples")]}
COMMON = [("start_s", "start, s", ".0f"), ("epilora_tune_s", "the plugin's tuning, s", ".0f"),
          ("torch_compile_s", "torch.compile, s", ".0f"),
          ("graph_capture_s", "graph capture, s", ".0f"),
          ("graph_capture_gib", "graph memory, GiB", ".2f"),
          ("kv_cache_tokens", "KV-cache tokens", ",.0f")]


def other_runs(*rows: dict) -> str | None:
    """Where `rows` come from more than one run (or one not known): what to say instead of a
    verdict. A target is judged side by side, on one run's engines only."""
    runs = sorted({r.get("commit") or "unknown" for r in rows})
    if len(runs) == 1 and runs != ["unknown"]:
        return None
    return f"not judged: rows of runs {' and '.join(f'`{c}`' for c in runs)}, not one run's"


def verdict(ratio: float, bound: float, better: str, *rows: dict) -> str:
    """`ratio` against its target's `bound`, judged where `rows` are one run's."""
    met = ratio <= bound if better == "lower" else ratio >= bound
    said = other_runs(*rows) or ("met" if met else "not met")
    return (f"**{ratio:.3f}x** (target at {'most' if better == 'lower' else 'least'} "
            f"{bound}x: {said})")


def target_lines(scenario: str, systems: dict) -> list[str]:
    metric, better, against_no_lora, against_stock = TARGETS[scenario]
    ours = systems.get("epilora", {}).get(metric)
    if not ours:
        return []
    lines = []
    no_lora = systems.get("no-lora", {}).get(metric)
    if no_lora:
        ratio = ours["value"] / no_lora["value"]
        lines.append(f"- Against stock without LoRA: "
                     f"{verdict(ratio, against_no_lora, better, ours, no_lora)}.")
    stock = [systems[s][metric] for s in STOCK_LORA if metric in systems.get(s, {})]
    if stock:
        pick = min if better == "lower" else max
        fastest = pick(stock, key=lambda r: r["value"])
        which = ("stock's fastest LoRA configuration measured here" if len(stock) > 1 else
                 "stock's LoRA path, the only configuration of it measured here")
        ratio = ours["value"] / fastest["value"]
        lines.append(f"- Against {which} ({fastest['system']}): "
                     f"{verdict(ratio, against_stock, better, ours, fastest)}.")
    # Against stock's LoRA engines' smallest capture and largest KV cache: the issue's bounds.
    for metric, what, bound, better in (
            ("graph_capture_s", "Graph capture time", 1.10, "lower"),
            ("graph_capture_gib", "Graph capture memory", 1.10, "lower"),
            ("kv_cache_tokens", "KV-cache tokens", 0.97, "higher")):
        mine = systems.get("epilora", {}).get(metric)
        stock = [systems[s][metric] for s in STOCK_LORA if metric in systems.get(s, {})]
        if mine and stock:
            best = (min if better == "lower" else max)(stock, key=lambda r: r["value"])
            lines.append(f"- {what} against stock's {best['system']}: "
                         f"{verdict(mine['value'] / best['value'], bound, better, mine, best)}.")
    return lines


# The start table's columns: (scenario of the log, metric, heading).
START_COLUMNS = [("start", "start_s", "first start, s"),
                 ("start", "model_load_s", "model loading, s"),
                 ("start", "epilora_tune_s", "the plugin's tuning, s"),
                 ("start", "torch_compile_s", "torch.compile, s"),
                 ("start", "graph_capture_s", "graph capture, s"),
                 ("restart", "start_s", "later start, s"),
                 ("restart", "torch_compile_s", "later torch.compile, s")]


def start_lines(starts: dict) -> list[str]:
    """The start scenario: each system's first and later start with their parts, then the
    issue's bounds, in seconds over stock's LoRA engine that started soonest."""
    present = [s for s in SYSTEMS if s in starts.get("start", {})]
    lines = ["| system | " + " | ".join(h for _, _, h in START_COLUMNS) + " |",
             "|---" * (len(START_COLUMNS) + 1) + "|"]
    for system in present:
        cells = [starts.get(run, {}).get(system, {}).get(metric)
                 for run, metric, _ in START_COLUMNS]
        lines.append(f"| {system} | " + " | ".join(
            "-" if c is None else f"{c['value']:.0f}" for c in cells) + " |")
    lines.append("")
    for run, what, bound in (("start", "First start", FIRST_START_S),
                             ("restart", "Later start", LATER_START_S)):
        systems = starts.get(run, {})
        mine = systems.get("epilora", {}).get("start_s")
        stock = [systems[s]["start_s"] for s in STOCK_LORA if "start_s" in systems.get(s, {})]
        if mine and stock:
            best = min(stock, key=lambda r: r["value"])
            extra = mine["value"] - best["value"]
            said = other_runs(mine, best) or ("met" if extra <= bound else "not met")
            lines.append(f"- {what} against stock's {best['system']}: **{extra:+.0f} s** "
                         f"(target at most +{bound} s: {said}).")
    return lines


def online_lines(rows: list) -> list[str]:
    """The online scenario: a row per system and rate, then the targets against stock's LoRA
    path (its best configuration at each rate) where both ran."""
    cell = {(r["system"], r["request_rate"], r["metric"]): r for r in rows if "request_rate" in r}
    rates = sorted({rate for _, rate, _ in cell})
    lines = ["| system | requests/s | median TPOT, ms | p99 TTFT, ms | median TTFT, ms | "
             "completed | failed |", "|---|---|---|---|---|---|---|"]
    for system in SYSTEMS:
        for rate in rates:
            tpot = cell.get((system, rate, "median_tpot_ms"))
            if tpot is None:
                continue

            def value(metric, system=system, rate=rate):
                r = cell.get((system, rate, metric))
                return f"{r['value']:.1f}" if r else "-"

            lines.append(f"| {system} | {rate:g} | {value('median_tpot_ms')} | "
                         f"{value('p99_ttft_ms')} | {value('median_ttft_ms')} | {tpot['n']} | "
                         f"{tpot['failed']} |")
    lines.append("")
    for rate in rates:
        ours = {m: cell.get(("epilora", rate, m)) for m in ("median_tpot_ms", "p99_ttft_ms")}
        for metric, bound, what in (("median_tpot_ms", ONLINE_TPOT, "median TPOT"),
                                    ("p99_ttft_ms", ONLINE_TTFT, "p99 TTFT")):
            stock = [cell[(s, rate, metric)] for s in STOCK_LORA if (s, rate, metric) in cell]
            if ours[metric] and not stock:
                lines.append(f"- {rate:g} requests/s, {what}: no stock LoRA configuration "
                             "measured at this rate (no target judged).")
            elif ours[metric]:
                best = min(stock, key=lambda r: r["value"])
                ratio = ours[metric]["value"] / best["value"]
                lines.append(f"- {rate:g} requests/s, {what} against {best['system']}: "
                             f"{verdict(ratio, bound, 'lower', ours[metric], best)}.")
    return lines


def main() -> None:
    header = ["# Serving benchmark: vLLM with the plugin against stock vLLM (H200)", "",
              f"<!-- Generated by tools/render_serving_docs.py from "
              f"{SOURCE.relative_to(ROOT)}. -->", ""]
    if not SOURCE.exists():
        PAGE.write_text("\n".join(header + ["Not measured yet (`bash tools/device/"
                                            "gpu_kernels.sh serving`).", ""]))
        return
    data = json.loads(SOURCE.read_text())
    meta = data["meta"]
    cells: dict = {}
    for r in data["rows"]:
        key = (r["metric"] + (f":{r['against']}" if "against" in r else "")
               + (f"@{r['request_rate']}" if "request_rate" in r else ""))
        scenario = r.get("scenario", "tpot1")
        cells.setdefault(r["model"], {}).setdefault(scenario, {}).setdefault(
            r["system"], {})[key] = r
    lines = header + [
        f"{meta['gpu']}, torch {meta['torch']}, vLLM {meta['vllm']}; made by "
        "`benchmarks/serving.py` (its docstring defines every system and scenario). Every "
        "engine runs in its own process; a table's engines ran in the runs named above it "
        "(commit and command; each run one device call, so one machine); dummy weights of the "
        "model's shapes, "
        "`quantization=\"fp8\"`, vLLM's default torch.compile and CUDA graphs, random rank-64 "
        "adapters. *TPOT*: time per output token at batch 1, median of the runs (ms); *base "
        "request*: a request without an adapter in the same LoRA engine; *output tokens/s*: "
        "median of the runs; *start*: `LLM(...)` (online: the server) until ready, on the "
        "caches the call's earlier engines left (s; the start scenario times each system's "
        "first start on empty caches of its own, and a later one); *graph "
        "capture*: vLLM's log line. Engine logs in `benchmarks/results/h200/serving-logs/`, "
        "one folder per run. The plugin runs in its defaults at the run's commit: its "
        "quantization mode (`EPILORA_VLLM_QUANTIZE`, [the plugin's page](../plugin.md)) is "
        "`codes` from commit 5eddee3 on, `kernels` before.", ""]
    for model, scenarios in cells.items():
        lines += [f"## {model}", ""]
        for scenario in (s for s in SCENARIO_TITLES if s in scenarios):
            systems = scenarios[scenario]
            # The start scenario's engines are logged under `start` and `restart`.
            logged = ([scenarios.get(run, {}) for run in ("start", "restart")]
                      if scenario == "start" else [systems])
            runs = sorted({(r.get("commit") or "?", r.get("command") or "?") for group in logged
                           for s in group.values() for r in s.values() if "against" not in r})
            lines += [f"### {SCENARIO_TITLES[scenario]}", "",
                      "; ".join(f"Commit `{c}`: `{cmd}`" for c, cmd in runs) + ".", ""]
            if scenario == "start":
                lines += [*start_lines(scenarios), ""]
                continue
            present = [s for s in SYSTEMS if s in systems]
            columns = COLUMNS.get(scenario, []) + COMMON
            if scenario == "online":
                lines += online_lines([r for s in present for r in systems[s].values()]) + [""]
            lines += ["| system | " + " | ".join(h for _, h, _ in columns) + " |",
                      "|---" * (len(columns) + 1) + "|"]
            for system in present:
                m = systems[system]
                cells_ = ["-" if k not in m else
                          ", ".join(f"{v:,.0f}" for v in m[k]["samples"]) if f == "samples" else
                          format(m[k]["value"], f) for k, _, f in columns]
                lines.append(f"| {system} | " + " | ".join(cells_) + " |")
            lines += ["", *(target_lines(scenario, systems) if scenario in TARGETS else [])]
            for s in STOCK_LORA:
                same = systems.get("epilora", {}).get(f"same_greedy_outputs:{s}")
                if same:
                    lines.append(f"- Greedy tokens (32, dummy weights) equal to {s}'s on "
                                 f"{same['value']} of {same['n']} prompts.")
            lines.append("")
    PAGE.write_text("\n".join(lines))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
