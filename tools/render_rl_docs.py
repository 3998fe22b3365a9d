"""Render docs/benchmarks/rl.md (and rl.png) from benchmarks/results/h200/rl.json (if it exists),
one section per part of the file (`epilora_testing.results.update_results`):

* memory (benchmarks/rl_memory.py): peak GPU memory and step time with one FP8 copy of the base
  against a bf16 trainer copy, with the RL issue's memory target;
* accuracy (benchmarks/rl_accuracy.py): SmolLM2's held-out accuracy before and after GRPO per
  rollout mode with 95% intervals, the engine-trainer mismatch of each mode against the issue's
  targets, training reward, step time and peak memory, TRL's GRPOTrainer beside them; a plot of
  reward and mismatch per step.

    python tools/render_rl_docs.py
"""

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).parents[1]
SOURCE = ROOT / "benchmarks/results/h200/rl.json"
PAGE = ROOT / "docs/benchmarks/rl.md"
PLOT = ROOT / "docs/benchmarks/rl.png"
SYSTEMS = ("fp8-one-copy", "bf16-trainer-copy")
TARGET_SAVED_GIB = 6.0  # the RL issue: one FP8 copy saves at least this much peak memory
ROLLOUT_SYSTEMS = ("bf16", "matched", "w8a8-tis", "trl")
TARGET_MATCHED_KL = 1.5  # the RL issue: matched's mismatch at most this times the bf16 pair's


def memory_section(meta: dict, rows: list) -> list[str]:
    cells: dict = {}
    for r in rows:
        cells.setdefault(r["model"], {}).setdefault(r["system"], {})[r["metric"]] = r
    lines = [
        "## Memory: one FP8 copy against a bf16 trainer copy", "",
        f"{meta['gpu']}, torch {meta['torch']}, commit `{meta['git_sha'][:10]}`, "
        f"{meta['date']}; `{meta['command']}` (the script's docstring says what each system "
        "holds). Each system in its own process: the matched engine (dummy weights of the "
        "model's shapes, FP8, LoRA on) and the trainer in one process, GRPO updates of rank-64 "
        "adapters on every projection with gradient checkpointing. *Peak*: torch's allocator "
        "over the updates, the engine's weights and KV cache included; *engine*, *trainer "
        "built*: allocated after the engine started and after the trainer was built; *step*: "
        "median of the updates after the first (s). Logs in `benchmarks/results/h200/rl-logs/`.",
        ""]
    for model, systems in cells.items():
        lines += [f"### {model}", "",
                  "| system | peak, GiB | engine, GiB | trainer built, GiB | step, s |",
                  "|---|---|---|---|---|"]
        for system in (s for s in SYSTEMS if s in systems):
            peak, step = systems[system]["peak_gpu_gib"], systems[system]["step_s"]
            lines.append(f"| {system} | {peak['value']:.1f} | {peak['engine_gib']:.1f} | "
                         f"{peak['trainer_built_gib']:.1f} | {step['value']:.2f} |")
        lines.append("")
        if all(s in systems for s in SYSTEMS):
            ours, theirs = (systems[s]["peak_gpu_gib"]["value"] for s in SYSTEMS)
            saved = theirs - ours
            ratio = (systems["fp8-one-copy"]["step_s"]["value"]
                     / systems["bf16-trainer-copy"]["step_s"]["value"])
            verdict = "met" if saved >= TARGET_SAVED_GIB else "missed"
            lines += [f"One FP8 copy peaks {saved:.1f} GiB lower (target: at least "
                      f"{TARGET_SAVED_GIB:.0f} GiB, {verdict}). Its step takes {ratio:.2f}x the "
                      "bf16 copy's, whose GEMMs are cuBLAS's: ours are Triton kernels, the "
                      "forward's with launch settings tuned for serving batches and the input "
                      "gradient's untuned (where the time goes is not measured yet).", ""]
    return lines


def _interval(row: dict | None) -> str:
    if row is None:
        return "-"
    low, high = row["ci95"]
    return f"{row['value']:.3f} [{low:.3f}, {high:.3f}]"


def accuracy_section(meta: dict, rows: list, plot_name: str | None) -> list[str]:
    cells: dict = {}
    for r in rows:
        key = r["metric"] + (f"-{r['phase']}" if "phase" in r else "")
        cells.setdefault(r["system"], {})[key] = r
    systems = [s for s in ROLLOUT_SYSTEMS if s in cells]
    first = next(iter(rows))
    together = first["jobs"] > 1
    lines = [
        f"## GRPO on SmolLM2-135M-Instruct: {', '.join(systems)}", "",
        f"{meta['gpu']}, torch {meta['torch']}, commit `{meta['git_sha'][:10]}`, "
        f"{meta['date']}; `{meta['command']}` (the script's docstring says what each system "
        f"is). Task `{first['task']}` (two-term sums and differences below 100), "
        f"{first['steps']} steps of {first['prompts_per_step']} prompts x {first['group_size']} "
        "samples. *Accuracy*: greedy, on held-out prompts, the mean over seeds with a 95% "
        "interval (t over seeds; Wilson over the prompts for one seed). *Mismatch*: the "
        "per-token KL (k3) of the engine's sampled tokens to the trainer's log-probabilities, "
        "the mean over every step and seed. *Reward*: training reward over the last "
        f"{cells[systems[0]]['reward']['last_steps']} steps. *Step*: median seconds "
        "per step after the first (rollouts, update, publish). "
        + (f"The {first['jobs']} runs shared the GPU at once: their step times include each "
           "other's load." if together else "The runs went one after another."), "",
        "| system | seeds | accuracy before | accuracy after | mismatch (KL/token) | reward | "
        "step, s | peak, GiB |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        c = cells[s]
        kl = c.get("kl_per_token")
        cols = [s, str(len(next(iter(c.values()))["seeds"])),
                _interval(c.get("accuracy-before")), _interval(c.get("accuracy-after")),
                f"{kl['value']:.2e}" if kl else "-",
                f"{c['reward']['value']:.3f}" if "reward" in c else "-",
                f"{c['step_s']['value']:.2f}" if "step_s" in c else "-",
                f"{c['peak_gpu_gib']['value']:.1f}" if "peak_gpu_gib" in c else "-"]
        lines.append("| " + " | ".join(cols) + " |")
    lines.append("")
    kl = {s: cells[s]["kl_per_token"]["value"] for s in systems if "kl_per_token" in cells[s]}
    if "bf16" in kl and "matched" in kl:
        ratio = kl["matched"] / kl["bf16"]
        verdict = "met" if ratio <= TARGET_MATCHED_KL else "missed"
        text = (f"Matched's mismatch is {ratio:.2f}x the bf16 pair's (target: at most "
                f"{TARGET_MATCHED_KL}x, {verdict})")
        if "w8a8-tis" in kl:
            text += f"; W8A8's is {kl['w8a8-tis'] / kl['bf16']:.1f}x the bf16 pair's"
        lines += [text + ".", ""]
    if plot_name:
        lines += [f"![training reward and mismatch per step]({plot_name})", ""]
    return lines


def plot(rows: list, path: Path) -> None:
    """Reward (mean over seeds) and mismatch per step, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in rows:
        if r["metric"] not in ("reward", "kl_per_token"):
            continue
        curve = [statistics.mean(v) for v in zip(*r["per_step"], strict=False)]
        ax = left if r["metric"] == "reward" else right
        ax.plot(range(1, len(curve) + 1), curve, label=r["system"])
    left.set_title("training reward (mean over seeds)")
    right.set_title("engine-trainer KL per token")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    header = ["# RL trainer (H200)", "",
              f"<!-- Generated by tools/render_rl_docs.py from {SOURCE.relative_to(ROOT)}. -->",
              ""]
    if not SOURCE.exists():
        PAGE.write_text("\n".join(header + ["Not measured yet (`bash tools/device/"
                                            "gpu_kernels.sh rl-memory rl-accuracy`).", ""]))
        return
    data = json.loads(SOURCE.read_text())
    lines = header
    plotted = False
    for part, meta in data["meta"]["parts"].items():
        rows = [r for r in data["rows"] if r["part"] == part]
        if part.endswith("-memory"):
            lines += memory_section(meta, rows)
        else:
            # One plot: the part with the most systems (the accuracy runs').
            first = not plotted and any(r["system"] == "matched" for r in rows) and \
                len({r["system"] for r in rows}) >= 2
            lines += accuracy_section(meta, rows, PLOT.name if first else None)
            if first:
                plot(rows, PLOT)
                plotted = True
    PAGE.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
