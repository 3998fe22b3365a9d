"""GPU: the decode path projection by projection against vLLM's quant + CUTLASS.

For each model's four projections at decode token counts, one rank-64 adapter: vLLM's quant +
CUTLASS, CUTLASS alone, our quant + K2 without adapter, the decode path (launch table, then the
heuristic alone), and the decode path serialized (no PDL). Each alone in a CUDA graph, L2
flushed, median. It found Llama-3.1-8B's gate_up decode K2 9 us slower than without its adapter
(a second wave of programs: _tiling.fit_waves).

    source tools/device/setup.sh
    python3 dev/decode_projections.py --out $OUT/decode_projections.json
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer import adapter_inputs, l2_flush_buffer, make_layer, time_graphs  # noqa: E402
from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402


def probe_decode(model, tokens_list, reps, flush, rows, rank=64, adapters=1):
    from vllm import _custom_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    projections = MODELS[model]
    layer = make_layer(adapters, rank, gen, projections)
    for tokens in tokens_list:
        batch, xs, _ = adapter_inputs(tokens, rank, adapters, gen, projections)
        for name, (weight, scale, lora) in layer.items():
            x = xs[name]
            codes, x_scale = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)

            def cutlass(x=x, w=weight, s=scale):
                c, xs_ = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
                return ops.cutlass_scaled_mm(c, w.t(), xs_, s, torch.bfloat16)

            def heuristic(x=x, w=weight, s=scale, lora=lora, batch=batch):
                os.environ["EPILORA_LAUNCH_TABLES"] = "0"
                try:
                    return ek.decode_lora_fp8_linear(x, w, s, lora, batch)
                finally:
                    os.environ.pop("EPILORA_LAUNCH_TABLES")

            fns = {"cutlass": cutlass,
                   "cutlass-mm": lambda c=codes, s=x_scale, w=weight, ws=scale:
                       ops.cutlass_scaled_mm(c, w.t(), s, ws, torch.bfloat16),
                   "ek-gemm": lambda x=x, w=weight, s=scale: ek.fp8_gemm_from_bf16(x, w, s),
                   "ek-decode": lambda x=x, w=weight, s=scale, lora=lora, batch=batch:
                       ek.decode_lora_fp8_linear(x, w, s, lora, batch),
                   "ek-decode-heuristic": heuristic,
                   "ek-decode-serial": lambda x=x, w=weight, s=scale, lora=lora, batch=batch:
                       ek.decode_lora_fp8_linear(x, w, s, lora, batch, pdl=False)}
            for key, us in time_graphs(fns, reps, flush).items():
                rows.append({"model": model, "projection": name, "tokens": tokens,
                             "kernel": key, "us": round(us, 2), "rank": rank})
                print(f"{model:12s} {name:8s} {tokens:5d} {key:24s} {us:8.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=["qwen3-8b", "llama3.1-8b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    flush = l2_flush_buffer()
    rows = []
    for model in args.models:
        probe_decode(model, args.tokens, args.reps, flush, rows)
        Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
