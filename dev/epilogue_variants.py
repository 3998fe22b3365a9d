"""GPU: K2's one-slot epilogue in tiles of 64 rows or more, two forms A/B in one process.

The shipped rule holds the adapter's slice of B in registers through the K loop wherever it
fits (`_tiling.b_in_registers`, `_tiling.epilogue_rank_chunk`). Since vLLM's expand arithmetic
(13d0321) those tiles hold 175 registers at rank 64 (3 blocks per SM became 2 where shared
memory allows 3); stepping through the rank instead, B loaded after the K loop 32 columns at a
time, compiles them to 48-72 (`dev/sm90_occupancy.py` with the rule below patched in). Which is
faster is this script's question: for each model's layer (its four FP8 projections), one
adapter of each rank and each token count, three CUDA graphs replayed in turns with the L2
flushed (benchmarks/layer.py's `time_graphs`): vLLM's quant + CUTLASS (`cutlass`), the
dispatcher `lora_linear` with the shipped rule (`epilora`) and with rank steps in every tile of
64 rows or more (`epilora-rank-steps`, the rule patched while its graph is captured, K2's
launch templates made again). The two epilora outputs are compared first (the forms sum the
rank in another order: relative error, not bits).

    source tools/device/setup.sh
    python3 dev/epilogue_variants.py --out $OUT/epilogue_variants.json \
        [--models qwen3-8b ...] [--ranks 16 64 128] [--tokens 64 128 256 512 2048]
"""

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer import adapter_inputs, l2_flush_buffer, make_layer, time_graphs, vllm_fp8_gemm  # noqa: E402
from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402
from epilora_kernels import _launchers, _tiling  # noqa: E402


def _steps_holds_b(cfg) -> bool:  # B held only below 64 rows (as shipped there)
    return (_tiling.b_fits_registers(cfg) and cfg.block_m < 64) or cfg.block_m == 32


def _steps_chunk(cfg) -> int:  # 32-wide rank steps in every tile of 64 rows or more
    return 32 if cfg.block_m >= 64 else 0


@contextlib.contextmanager
def rank_steps():
    """K2 launched with rank steps in every tile of 64 rows or more while inside."""
    shipped = _tiling.b_in_registers, _tiling.epilogue_rank_chunk
    _tiling.b_in_registers, _tiling.epilogue_rank_chunk = _steps_holds_b, _steps_chunk
    _launchers._K2_TEMPLATES.clear()  # templates keep the form they were made with
    try:
        yield
    finally:
        _tiling.b_in_registers, _tiling.epilogue_rank_chunk = shipped
        _launchers._K2_TEMPLATES.clear()


def run_layer(system: str, xs: dict, layer: dict, batch, out: dict) -> None:
    for name, (weight, scale, lora) in layer.items():
        if system == "cutlass":
            out[name] = vllm_fp8_gemm(xs[name], weight, scale)
        elif system == "epilora":
            out[name] = ek.lora_linear(xs[name], weight, scale, lora, batch,
                                       base_gemm=vllm_fp8_gemm)
        else:
            with rank_steps():
                out[name] = ek.lora_linear(xs[name], weight, scale, lora, batch,
                                           base_gemm=vllm_fp8_gemm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 2048])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    rows = []
    print(f"{'model':12s} {'rank':>4s} {'tokens':>6s} {'cutlass':>8s} {'shipped':>8s} "
          f"{'steps':>8s} {'steps/shipped':>13s} {'rel err':>8s}", flush=True)
    for model in args.models:
        projections = MODELS[model]
        for rank in args.ranks:
            layer = make_layer(1, rank, gen, projections)
            for tokens in args.tokens:
                batch, xs, _ = adapter_inputs(tokens, rank, 1, gen, projections)
                outs = {system: {} for system in ("cutlass", "epilora", "epilora-rank-steps")}
                runs = {system: functools.partial(run_layer, system, xs, layer, batch, out)
                        for system, out in outs.items()}
                for run in runs.values():
                    run()
                torch.cuda.synchronize()
                err = max(((outs["epilora-rank-steps"][p].float() - outs["epilora"][p].float())
                           .norm() / outs["epilora"][p].float().norm()).item() for p in layer)
                times = time_graphs(runs, args.reps, flush)
                for system, us in times.items():
                    rows.append({"model": model, "rank": rank, "adapters": 1, "tokens": tokens,
                                 "system": system, "layer_us": round(us, 2), "n": args.reps,
                                 "rel_err_vs_epilora": round(err, 6)})
                print(f"{model:12s} {rank:4d} {tokens:6d} {times['cutlass']:8.1f} "
                      f"{times['epilora']:8.1f} {times['epilora-rank-steps']:8.1f} "
                      f"{times['epilora-rank-steps'] / times['epilora']:13.3f} {err:8.1e}",
                      flush=True)
                Path(args.out).write_text(json.dumps(rows, indent=1))  # a cut-short run keeps
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
