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


def _cells(rows: list) -> dict:
    """{(part, system): {metric[-phase]: row}}, systems in ROLLOUT_SYSTEMS order."""
    cells: dict = {}
    for r in sorted(rows, key=lambda r: ROLLOUT_SYSTEMS.index(r["system"])):
        key = r["metric"] + (f"-{r['phase']}" if "phase" in r else "")
        cells.setdefault((r["part"], r["system"]), {})[key] = r
    return cells


def _table(cells: dict, parts: dict) -> list[str]:
    lines = ["| system | run | seeds | accuracy before | accuracy after | mismatch (KL/token) | "
             "reward | step, s | peak, GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for (part, system), c in cells.items():
        kl = c.get("kl_per_token")
        seeds = max(len(r.get("seeds", [])) for r in c.values())
        cols = [system, f"`{parts[part]['git_sha'][:7]}`, {next(iter(c.values()))['jobs']} "
                "at once", str(seeds),
                _interval(c.get("accuracy-before")), _interval(c.get("accuracy-after")),
                f"{kl['value']:.2e}" if kl else "-",
                f"{c['reward']['value']:.3f}" if "reward" in c else "-",
                f"{c['step_s']['value']:.2f}" if "step_s" in c else "-",
                f"{c['peak_gpu_gib']['value']:.1f}" if "peak_gpu_gib" in c else "-"]
        lines.append("| " + " | ".join(cols) + " |")
    return lines + [""]


def accuracy_section(parts: dict, rows: list) -> list[str]:
    """The SmolLM2 runs: the accuracy runs (several at once on the GPU), then the runs made one
    at a time beside TRL."""
    together = [r for r in rows if r["jobs"] > 1]
    alone = [r for r in rows if r["jobs"] == 1]
    first = rows[0]
    eval_size = next(r["eval_size"] for r in rows if "eval_size" in r)
    last = next(r["last_steps"] for r in rows if "last_steps" in r)
    lines = [
        "## GRPO on SmolLM2-135M-Instruct", "",
        f"`benchmarks/rl_accuracy.py` (its docstring says what each system is); task "
        f"`{first['task']}`, two-term sums and differences below 100, the answer the first "
        f"line's last number; each step {first['prompts_per_step']} prompts x "
        f"{first['group_size']} samples, rank-{first['rank']} adapters on every projection. "
        f"*Accuracy*: greedy, on {eval_size} held-out prompts, the mean over seeds with a 95% "
        "interval: Student's t over the seeds, or Wilson over the prompts for one seed. In the "
        "runs below, seed s's prompts were seed 0's shifted by s (reasoning-gym seeds item i "
        "with seed + i; epilora-rl now spaces run seeds apart): their t intervals measure the "
        "training's randomness on nearly one held-out set, and leave out that set's own "
        "sampling error, which is about as wide as the one-seed Wilson intervals. *Mismatch*: "
        "the per-token KL (k3) of the engine's sampled tokens to the trainer's "
        "log-probabilities, the mean over every step and seed. *Reward*: training reward over "
        f"the last {last} steps. *Step*: median seconds per step after the first; ours here "
        "are rollouts and update (generate_s + train_s: publishing the adapter and writing the "
        "step's files are left out; epilora-rl now records the whole step as step_s), TRL's "
        "its whole optimizer step, weight sync included. *Peak*: torch's allocator, the "
        "engine's KV cache included. Runs, their commands and notes:", ""]
    for meta in parts.values():
        note = f" ({meta['note']})" if "note" in meta else ""
        lines.append(f"- `{meta['git_sha'][:7]}`, {meta['date']}: `{meta['command']}`{note}")
    lines.append("")
    if together:
        steps = together[0]["steps"]
        lines += [f"### Accuracy and mismatch per rollout mode ({steps} steps)", "",
                  "Several runs shared the GPU at once (the *run* column): their step times "
                  "include each other's load.", ""]
        lines += _table(_cells(together), parts)
        kl, run_of = {}, {}
        for r in together:
            if r["metric"] == "kl_per_token":
                if r["system"] in kl:
                    raise SystemExit(f"{r['system']}: mismatch rows in more than one part")
                kl[r["system"]] = r["value"]
                run_of[r["system"]] = parts[r["part"]]["git_sha"][:7]
        if "bf16" in kl and "matched" in kl:
            ratio = kl["matched"] / kl["bf16"]
            verdict = "met" if ratio <= TARGET_MATCHED_KL else "missed"
            runs = ("" if run_of["matched"] == run_of["bf16"] else
                    f"; from two runs: matched's at `{run_of['matched']}`, the bf16 pair's at "
                    f"`{run_of['bf16']}`")
            text = (f"Matched's mismatch is {ratio:.2f}x the bf16 pair's (target: at most "
                    f"{TARGET_MATCHED_KL}x, {verdict}{runs})")
            if "w8a8-tis" in kl:
                text += f"; W8A8's is {kl['w8a8-tis'] / kl['bf16']:.1f}x the bf16 pair's"
            lines += [text + ".", ""]
    if alone:
        steps = alone[0]["steps"]
        lines += [f"### Beside TRL's GRPOTrainer, one run at a time ({steps} steps)", "",
                  "The same prompts in the same order, reward, GRPO settings and vLLM memory "
                  "share; TRL trains a bf16 copy with PEFT and pushes the merged weights to its "
                  "colocated vLLM before each rollout, ours trains on the matched engine's own "
                  "FP8 weights and publishes the adapter alone. One seed each: the reward over "
                  "a few steps of one run is noisy (the accuracy runs' seeds differ by as "
                  "much), and at 135M parameters both peaks are mostly the same vLLM memory "
                  "share, so neither column compares the systems; the memory comparison is the "
                  "Qwen3-8B one above. Where our step's time goes is not measured.", ""]
        lines += _table(_cells(alone), parts)
    lines += ["![training reward and mismatch per step](rl.png)", ""]
    return lines


def plot(rows: list, path: Path) -> None:
    """Reward and mismatch per step of the accuracy runs (means over seeds), and the reward of
    the runs beside TRL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    panels = [(axes[0], "reward", True, "training reward, accuracy runs (mean over seeds)"),
              (axes[1], "kl_per_token", True, "engine-trainer KL per token"),
              (axes[2], "reward", False, "training reward, beside TRL")]
    for ax, metric, together, title in panels:
        for r in rows:
            if r["metric"] == metric and (r["jobs"] > 1) == together:
                curve = [statistics.mean(v) for v in zip(*r["per_step"], strict=False)]
                ax.plot(range(1, len(curve) + 1), curve, label=r["system"],
                        color=f"C{ROLLOUT_SYSTEMS.index(r['system'])}")  # one colour a system
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
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
    if "parts" not in data["meta"]:
        raise SystemExit(f"{SOURCE}: no parts (written by epilora_testing.results."
                         "update_results)")
    parts = data["meta"]["parts"]
    lines = header
    for part, meta in parts.items():
        if part.endswith("-memory"):
            lines += memory_section(meta, [r for r in data["rows"] if r["part"] == part])
    rollouts = [r for r in data["rows"] if r["system"] in ROLLOUT_SYSTEMS]
    if rollouts:
        lines += accuracy_section({p: m for p, m in parts.items()
                                   if any(r["part"] == p for r in rollouts)}, rollouts)
        plot(rollouts, PLOT)
    PAGE.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
