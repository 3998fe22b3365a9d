"""Decode benchmark: one Qwen3-8B layer at 1-32 tokens, the decode path (PDL) against the rest.

Systems (one CUDA graph per system and case, L2 flushed before each replay, median of replays):
`cutlass` (vLLM quant + CUTLASS, no adapter), `vllm-default` (+ Punica shrink/expand),
`epilora-serialized` (our shrink, then K2 quantizing in-kernel, without PDL), `epilora-decode`
(the same with K2 as the shrink's programmatic dependent) and the lower bound `epilora-h-given`
(K2 alone, h already computed). Not measured yet: vLLM's dual stream, the other overlap controls.

    python3 benchmarks/decode.py --out benchmarks/results/h200/decode.json
"""

import argparse
import functools

import torch
from layer import PROJECTIONS, _write, make_layer, run_layer, time_graph

from epilora_kernels import fused
from epilora_kernels.batch import AdapterBatch

TOKENS = (1, 4, 8, 16, 32)
RANKS = (16, 64, 128)


def run_decode(system: str, xs, layer, batch, hs) -> None:
    for name, (weight, scale, lora) in layer.items():
        x = xs[name]
        if system == "epilora-h-given":
            fused.lora_fp8_gemm_from_bf16(x, weight, scale, hs[name], lora, batch)
        else:
            fused.decode_lora_fp8_linear(x, weight, scale, lora, batch,
                                         pdl=system == "epilora-decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for rank in RANKS:
        layer = make_layer(1, rank, gen)
        for tokens in TOKENS:
            batch = AdapterBatch.from_token_mapping(
                torch.zeros(tokens, dtype=torch.int32, device="cuda"), 1)
            meta = (batch.token_lora_mapping, batch.sorted_token_indices,
                    batch.num_tokens_per_lora, batch.lora_token_start, batch.lora_ids,
                    torch.tensor([False]), torch.tensor([2], dtype=torch.int32))
            xs = {name: torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
                  for name, (k, _) in PROJECTIONS.items()}
            bufs = {name: torch.zeros(len(s), tokens, rank, device="cuda")
                    for name, (_, s) in PROJECTIONS.items()}
            hs = {name: fused.lora_shrink(xs[name], lora, batch)
                  for name, (_, _, lora) in layer.items()}
            for system in ("cutlass", "vllm-default", "epilora-serialized", "epilora-decode",
                           "epilora-h-given"):
                if system in ("cutlass", "vllm-default"):
                    run = functools.partial(run_layer, system, xs, layer, batch, meta, bufs)
                else:
                    run = functools.partial(run_decode, system, xs, layer, batch, hs)
                us = time_graph(run, args.reps, flush)
                rows.append({"bench": "decode", "model": "qwen3-8b", "base": "fp8",
                             "system": system, "tokens": tokens, "rank": rank,
                             "adapters": 0 if system == "cutlass" else 1,
                             "metric": "layer_us", "value": round(us, 2), "n": args.reps})
                print(f"{system:19s} rank={rank:3d} tokens={tokens:3d} {us:8.1f} us", flush=True)
        _write(args, rows)


if __name__ == "__main__":
    main()
