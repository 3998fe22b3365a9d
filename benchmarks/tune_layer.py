"""Tune the decode (or fused) path's K1 or K2 by the whole layer's time, one projection at a time.

`tune.py --ops decode` times each projection's K1 with that projection's K2 alone; its winners
differ by about the decode layer's run-to-run spread, and a setting that makes one projection
faster can make the layer slower (docs/kernels-history.md, items 21-23). Here every candidate is
timed in the layer it serves: one Qwen3-8B layer's decode path (4 projections, tokens round
robin over `--adapters` adapters of rank `--rank`) in a CUDA graph, the L2 flushed before each
replay, median of `--reps`. One projection's K1 setting changes at a time, the others keep their
current ones (the installed table's to begin with): coordinate descent, `--passes` rounds over
the projections. Before each projection's candidates the current settings are timed again (the
run's drift), and a candidate replaces the current setting only when it is faster than that
by more than `--margin` us. Each candidate's output for its projection is checked against the
installed settings' (relative 1e-2: split orders differ in the last bits). At the end the
installed and the tuned settings are timed in turns (`--reps` each, `--confirm` times), and the
tuned ones are written only if their median beats the installed ones' by `--margin`.

Beyond 32 tokens (`--tokens 64 128 256`) K1's candidates are few programs over wide rank
tiles (tune.py's `decode_prefill_k1_candidates`), the installed settings there the fused
path's K1; the entries written cover the decode path's K1 up to their bucket
(`launch.select_config`).

`--path fused` tunes the fused path's K1 (`quantize_shrink`) the same way, by the fused layer's
time: beyond 32 tokens K2 is K1's programmatic dependent and can wait beside K1 only when K1's
programs leave room for it (at 256 tokens and rank 128 the shipped K1 leaves 28-75 KB of an
SM's shared memory free, K2 needs 65-98 KB: sm90_occupancy.json; serialized, every K2 program
started 1.3 us after K1's end, decode_timeline_prefill_r128_256.json), so its candidates there
are tune.py's K1 candidates and the few-program ones.

`--kernel k2` tunes the path's K2 instead (tune.py's K2 candidates): its table entries were
chosen without adapters (tune.py's default) or one projection at a time (`--ops k2-lora`),
never in the layer beside K1, with the decode path's wait and epilogue. One `lora_gemm` entry
serves both paths' K2 (beyond 32 tokens, `--path` picks the layer that judges it; the layer
page measures both).

Writes the settings that changed, the installed table's other entries kept, and every timing:
K1's as `decode_shrink` entries (rank keys beside rank 64, as tune.py does), K2's as `lora_gemm`
entries always under the rank's key (plain `lora_gemm` keys also serve the GEMM without
adapters, which looks them up at rank 16), with one adapter under its one-slot key
(`launch.ONE_SLOT`: K2's one-slot epilogue is another kernel than the several-slot one):

    python3 benchmarks/tune_layer.py --rank 128 --tokens 4 8 --out-table $OUT/NVIDIA_H200.json \
        --out $OUT/tune_layer.json
"""

import argparse
import functools
import statistics

import torch
from layer import PROJECTIONS, adapter_inputs, l2_flush_buffer, make_layer, write_results
from tune import (
    RANK,
    decode_prefill_k1_candidates,
    entry_rank,
    installed_table,
    k1_candidates,
    k2_candidates,
    rel,
    timed,
    timing_row,
)

import epilora_kernels as ek
from epilora_kernels.launch import (
    DECODE_SHRINK_MAX_TOKENS,
    LaunchConfig,
    select_config,
    shape_key,
    write_table,
)

CHECK_TOLERANCE = 1e-2  # relative, against the installed settings' output


# What --kernel tunes: the launchers' keyword for its settings and, by --path, the table's op.
KERNELS = {"k1": "k1_config", "k2": "k2_config"}
OPS = {("decode", "k1"): "decode_shrink", ("decode", "k2"): "lora_gemm",
       ("fused", "k1"): "quantize_shrink", ("fused", "k2"): "lora_gemm"}
LINEAR = {"decode": ek.decode_lora_fp8_linear, "fused": ek.fused_lora_fp8_linear}


def path_layer(xs: dict, layer: dict, batch, path: str, kernel: str, configs: dict) -> dict:
    """The path over the layer's projections, `kernel` (k1 or k2) with `configs[name]` where
    given (else the installed table's); the outputs by projection."""
    linear, keyword = LINEAR[path], KERNELS[kernel]
    return {name: linear(xs[name], weight, scale, lora, batch, **{keyword: configs.get(name)})
            for name, (weight, scale, lora) in layer.items()}


def candidates(path: str, kernel: str, tokens: int, rank: int, name: str,
               k1_stages: tuple[int, ...] = (2,)) -> list[LaunchConfig]:
    k, slices = PROJECTIONS[name]
    if kernel == "k2":
        return k2_candidates(tokens, slices, rank)
    if tokens <= DECODE_SHRINK_MAX_TOKENS:
        return k1_candidates(tokens, rank, k, k1_stages)
    few = decode_prefill_k1_candidates(rank, k)
    if path == "decode":
        return few
    return list(dict.fromkeys(k1_candidates(tokens, rank, k) + few))  # in order, once each


def tune_tokens(tokens, layer, args, gen, flush, row) -> dict[str, LaunchConfig]:
    """The settings that beat the installed ones in the layer at `tokens`, by projection."""
    batch, xs, _ = adapter_inputs(tokens, args.rank, args.adapters, gen)
    layer_with = functools.partial(path_layer, xs, layer, batch, args.path, args.kernel)
    want = layer_with({})
    chosen: dict[str, LaunchConfig] = {}
    for round_ in range(args.passes):
        for name in args.projections:
            current = timed(functools.partial(layer_with, chosen), args.reps, flush)[1]
            row("current", name, tokens, current, chosen.get(name), round=round_)
            best = (float("inf"), None)
            for cfg in candidates(args.path, args.kernel, tokens, args.rank, name,
                                  tuple(args.k1_stages)):
                run = functools.partial(layer_with, {**chosen, name: cfg})
                ok, us = timed(run, args.reps, flush,
                               lambda run=run, name=name:
                               rel(run()[name], want[name]) < CHECK_TOLERANCE)
                row("candidate", name, tokens, us, cfg, ok=ok, round=round_)
                best = min(best, (us, cfg), key=lambda b: b[0])
            taken = best[0] < current - args.margin
            if taken:
                chosen[name] = best[1]
            print(f"T={tokens:3d} round {round_} {name:8s} current {current:7.1f} us  "
                  f"best {best[0]:7.1f} us {'taken' if taken else 'not taken'}: {best[1]}",
                  flush=True)
    # The installed and the tuned settings in turns, so that drift hits both alike.
    turns = {"installed": [], "tuned": []}
    for _ in range(args.confirm):
        for label, cfgs in (("installed", {}), ("tuned", chosen)):
            turns[label].append(timed(functools.partial(layer_with, cfgs), args.reps, flush)[1])
    for label, times in turns.items():
        row(f"layer-{label}", None, tokens, statistics.median(times), times=times)
    installed, tuned = (statistics.median(turns[label]) for label in ("installed", "tuned"))
    kept = tuned < installed - args.margin
    print(f"T={tokens:3d} layer: installed {installed:7.1f} us  tuned {tuned:7.1f} us: "
          f"{'written' if kept else 'installed settings kept'}", flush=True)
    return chosen if kept else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True,
                        help="token counts (K2's entries serve both paths)")
    parser.add_argument("--kernel", choices=tuple(KERNELS), default="k1",
                        help="k1: the path's shrink (decode_shrink, or quantize_shrink with "
                             "--path fused); k2: its GEMM (lora_gemm, under the rank's key)")
    parser.add_argument("--path", choices=("decode", "fused"), default="decode",
                        help="the path whose layer times the candidates")
    parser.add_argument("--rank", type=int, default=RANK,
                        help=f"the adapters' rank; K1's entries other than {RANK}'s go under "
                             "rank keys")
    parser.add_argument("--projections", nargs="+", choices=tuple(PROJECTIONS),
                        default=list(PROJECTIONS),
                        help="tune these (the others keep the installed settings); each K2 "
                             "candidate compiles per slice count, a few seconds each")
    parser.add_argument("--adapters", type=int, default=1)
    parser.add_argument("--k1-stages", type=int, nargs="+", default=[2],
                        help="K1's pipeline depths offered up to 32 tokens (tune.k1_candidates)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--margin", type=float, default=0.3,
                        help="us a candidate must gain over the current settings")
    parser.add_argument("--confirm", type=int, default=5)
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    layer = make_layer(args.adapters, args.rank, gen)  # as decode.py and decode_timeline.py
    op = OPS[args.path, args.kernel]
    # K2 timed with one slot ran its one-slot epilogue: its entries serve such batches only;
    # anything timed with several slots serves several-slot batches only, under a rank key
    # (launch.shape_key).
    one_slot = (False if args.adapters > 1 else True if args.kernel == "k2" else None)
    key_rank = args.rank if one_slot is False else entry_rank(args.rank, args.kernel == "k2")
    table = installed_table()
    table.setdefault(op, {})
    meta = table.setdefault("_meta", {})
    run = {"git_sha": args.git_sha, "mode": f"{args.path}-layer",
           "tool": "benchmarks/tune_layer.py",
           "ops": [op], "adapters": args.adapters, "slots": args.adapters,
           "rank": args.rank, "tokens": []}
    meta["runs"] = [*meta.get("runs", []), run]
    rows = []

    def row(kind, name, tokens, us, cfg=None, **extra):
        rows.append(timing_row({"bench": "tune-layer", "path": args.path,
                                "kernel": args.kernel, "kind": kind,
                                "projection": name, "tokens": tokens}, "layer_us", us, cfg,
                               args.reps, extra))

    for tokens in args.tokens:
        chosen = tune_tokens(tokens, layer, args, gen, flush, row)
        if op == "decode_shrink" and tokens > DECODE_SHRINK_MAX_TOKENS:
            # A decode_shrink bucket beyond 32 tokens serves every batch down to the next
            # bucket, so it holds every projection's settings: the installed ones
            # (select_config's) where nothing beat them.
            chosen = {name: chosen.get(name) or select_config(
                torch.cuda.get_device_name(), op, tokens, sum(slices), k, args.rank, slices)
                for name, (k, slices) in PROJECTIONS.items()}
        for name, cfg in chosen.items():
            k, slices = PROJECTIONS[name]
            table[op].setdefault(shape_key(sum(slices), k, key_rank, one_slot), {})[
                str(tokens)] = cfg.__dict__
        run["tokens"].append(tokens)
        write_table(table, args.out_table)
        write_results(args, rows)  # after every count: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
