"""The tuner (epilora_kernels.tuner) on each model's four projections at the decode buckets:
what it costs (seconds per model, the plugin pays it at engine start) and what it found (the
decode path's time per projection before and after, as the tuner measured it; before is the
settings in use, so from the second model or setup on it includes what the earlier ones
cached). The cache it writes goes to $EPILORA_CACHE_DIR, which the layer benchmark of the
same call then reads. Its seconds are this benchmark's budget and compile processes over a
model's four projections at once; the plugin's start tunes each projection on its own
budget, in threads, on the codes (docs/plugin.md, "Timed dispatch").

    EPILORA_CACHE_DIR=out/cache python3 benchmarks/tune_decode.py --models llama3.1-8b \\
        --ranks 16 64 128 --slots 1 8 --budget 60 --out benchmarks/results/h200/tune_decode.json

`--setups SLOTSxRANK ...` (the layer benchmark's setups, e.g. 1x16 8x16 32x64) tunes those
pairs instead of every rank with every slot count; `--tokens` the buckets (default the
tuner's, `tuner.default_buckets`: 1-64 with one slot, 1-32 with several; setups of several
slots leave out buckets given beyond 32, which the decode path does not serve for them).
"""

import argparse

from layer import write_results
from models import MODELS

import epilora_kernels.tuner as tuner
from epilora_kernels.dispatch import decode_max_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--ranks", "--rank", type=int, nargs="+", default=[64])
    parser.add_argument("--slots", type=int, nargs="+", default=[1],
                        help="adapter slots of the batches tuned for (1: the one-slot entries)")
    parser.add_argument("--setups", nargs="+", metavar="SLOTSxRANK",
                        help="these (slots, rank) pairs instead of --ranks x --slots")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per model")
    parser.add_argument("--jobs", type=int, default=15,
                        help="compile the candidates in this many processes first (0: none)")
    parser.add_argument("--codes", action="store_true",
                        help="tune the path on per-token codes given (x None), as the vLLM "
                             "plugin's default mode calls it")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="the token buckets (default: the tuner's, 1 4 8 16 32 64 with "
                             "one slot, 1 4 8 16 32 with several)")
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    pairs = ([parse_setup(s, parser) for s in args.setups] if args.setups
             else [(slots, rank) for rank in args.ranks for slots in args.slots])
    rows = []
    for model in args.models:
        for slots, rank in pairs:
            rows += tune(model, rank, slots, args)
            write_results(args, rows)


def parse_setup(text: str, parser: argparse.ArgumentParser) -> tuple[int, int]:
    """'8x16' -> (8 slots, rank 16); a clear error otherwise."""
    try:
        slots, rank = (int(v) for v in text.split("x"))
    except ValueError:
        parser.error(f"--setups takes SLOTSxRANK, e.g. 8x16, not {text!r}")
    if slots < 1 or rank < 1:
        parser.error(f"--setups {text!r}: slots and rank must be positive")
    return slots, rank


def buckets(args, slots: int) -> tuple[int, ...]:
    """--tokens (not given: the tuner's default for `slots`), but the buckets the decode path
    does not serve with `slots` (beyond dispatch.decode_max_tokens, where the fused path takes
    the batch), said once."""
    if args.tokens is None:
        return tuner.default_buckets(slots)
    most = decode_max_tokens(slots == 1)
    served = tuple(t for t in args.tokens if t <= most)
    if served != tuple(args.tokens):
        print(f"{slots} slots: the decode path serves up to {most} tokens; tuning {served}")
    return served


def tune(model: str, rank: int, slots: int, args) -> list[dict]:
    """One model at one rank and slot count: the tuner's rows."""
    report = tuner.tune_decode(MODELS[model], rank=rank, slots=slots, budget_s=args.budget,
                               jobs=args.jobs, codes=args.codes, tokens=buckets(args, slots))
    total = report["compile_s"] + sum(report["seconds"].values())
    common = {"bench": "tune_decode", "model": model, "base": "fp8", "rank": rank,
              "adapters": slots, "x": "codes" if args.codes else "bf16"}
    rows = []
    for cell in report["cells"]:
        if cell["before_us"] is None:  # the settings in use failed to run: nothing to compare
            continue
        for when in ("before", "after"):
            rows.append({**common, "system": f"tuner-{when}", "projection": cell["projection"],
                         "tokens": cell["tokens"], "metric": "decode_us",
                         "value": round(cell[f"{when}_us"], 2)})
        # the settings chosen, so that a heuristic can be read from (and checked against) the
        # tuner's picks without its cache: K1's and K2's LaunchConfig fields, the path chosen
        # where the tuner timed the fused path too (None: the size rule's)
        rows[-1].update(k1=cell["k1"], k2=cell["k2"], path=cell["path"])
    rows.append({**common, "system": "tuner", "metric": "tune_s", "value": round(total, 1),
                 "complete": report["complete"], "budget_s": args.budget,
                 "compile_s": report["compile_s"], "jobs": args.jobs,
                 "compile_errors": len(report["compile_errors"]),
                 "failed": len(report.get("failed", [])),
                 "seconds_per_projection": report["seconds"]})
    state = "complete" if report["complete"] else "budget reached"
    print(f"{model} rank {rank}, {slots} slot(s), x {common['x']}: {total:.1f} s, "
          f"compile {report['compile_s']} s ({state}) {report['seconds']}", flush=True)
    for error in report["compile_errors"][:20]:  # a stopped worker says where it was
        print(f"  compile: {error}", flush=True)
    return rows


if __name__ == "__main__":
    main()
