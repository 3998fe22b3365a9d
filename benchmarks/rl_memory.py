"""The RL trainer's memory at a real model's shapes: one FP8 copy of the base, shared by the
engine and the trainer (`fp8-one-copy`: epilora-rl's trainable model over the engine's own
tensors), against a bf16 trainer copy beside the FP8 engine (`bf16-trainer-copy`: what a trainer
with its own bf16 weights holds, the base dequantized once into bf16 linears).

Each system runs in its own process: the matched engine (vLLM with epilora-vllm's W8A16 mode,
dummy weights of the model's shapes, `quantization="fp8"`, LoRA on, `enforce_eager`), then the
trainer, then `--steps` GRPO updates (rank-64 adapters on every projection, gradient
checkpointing, AdamW) on `--batch` random sequences of `--tokens` tokens with random
advantages. Rows: peak GPU memory over the run (torch's allocator, the engine's weights and KV
cache included) and the median step time.

    python3 benchmarks/rl_memory.py --out results/h200/rl.json
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from serving import CONFIGS, RANK, results_of, run_worker  # noqa: I001 (the serving benchmark's)

from epilora_testing.results import update_results

SYSTEMS = ("fp8-one-copy", "bf16-trainer-copy")


def bf16_copy(model) -> None:
    """Replace every epilora-rl projection by a bf16 linear (weight = codes x scale, once) with
    the same adapter in torch: the trainer's own bf16 copy of the base."""
    import torch

    from epilora_rl import Fp8LoraLinear

    class Bf16LoraLinear(torch.nn.Module):
        def __init__(self, src: Fp8LoraLinear):
            super().__init__()
            scale = src.weight_scale.reshape(-1, 1) if src.weight_scale.numel() > 1 \
                else src.weight_scale
            self.weight = torch.nn.Parameter((src.weight.to(torch.float32) * scale)
                                             .to(torch.bfloat16), requires_grad=False)
            self.lora_A, self.lora_B, self.scaling = src.lora_A, src.lora_B, src.scaling

        def forward(self, x):
            y = torch.nn.functional.linear(x, self.weight)
            a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
            return y + (x @ a.T) @ b.T * self.scaling

    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8LoraLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Bf16LoraLinear(module))


def worker(args) -> None:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", EPILORA_VLLM_MATCHED="1")
    import torch
    from vllm import LLM

    from epilora_rl.grpo import GrpoLoss
    from epilora_rl.model import trainable_model

    llm = LLM(args.model_dir, load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              enable_lora=True, max_loras=1, max_lora_rank=RANK, max_model_len=4096,
              max_num_seqs=8, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=True, seed=0)
    engine_gib = torch.cuda.memory_allocated() / 2**30
    model = trainable_model(llm, args.model_dir, rank=RANK, alpha=2 * RANK)
    if args.system == "bf16-trainer-copy":
        bf16_copy(model)
    torch.cuda.synchronize()
    trainer_built_gib = torch.cuda.memory_allocated() / 2**30
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    loss_fn = GrpoLoss(loss_type="dapo")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    model.train()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.tokens), generator=gen).cuda()
        advantages = torch.randn(args.batch, generator=gen).cuda()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1].float()
        logps = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        del logits
        loss = loss_fn(logps, logps.detach(), advantages, torch.ones_like(logps))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    print("RESULT " + json.dumps({
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "engine_gib": engine_gib,
        "trainer_built_gib": trainer_built_gib, "step_s": times,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b", choices=list(CONFIGS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--timeout", type=int, default=400, help="seconds per system")
    parser.add_argument("--out", default=None)
    parser.add_argument("--logs", default="/tmp/epilora-rl-memory")
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    logs = Path(args.logs)
    model_dir = logs / args.model
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIGS[args.model]))
    rows, env, failures = [], {}, []
    for system in args.systems:
        cmd = [sys.executable, __file__, "--worker", "--system", system, "--model-dir",
               str(model_dir), "--steps", str(args.steps), "--batch", str(args.batch),
               "--tokens", str(args.tokens),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        print(f"{args.model} {system} ...", flush=True)
        log, _ = run_worker(cmd, timeout=args.timeout)
        (logs / f"rl-memory-{args.model}-{system}.log").write_text(log)
        results = results_of(log)
        if not results:
            failures.append(f"{system}: no result, see {logs}")
            continue
        result = results[0]
        env = {"gpu": result["gpu"], "torch": result["torch"]}
        base = {"bench": "rl", "model": args.model, "base": "fp8", "system": system,
                "rank": RANK, "batch": args.batch, "tokens": args.tokens}
        rows += [{**base, "metric": "peak_gpu_gib", "value": result["peak_gpu_gib"], "n": 1,
                  "engine_gib": result["engine_gib"],
                  "trainer_built_gib": result["trainer_built_gib"]},
                 {**base, "metric": "step_s", "value": statistics.median(result["step_s"][1:]),
                  "n": len(result["step_s"]) - 1, "samples": result["step_s"]}]
    for r in rows:
        print(f"{r['system']:18} {r['metric']:14} {r['value']:.3f}")
    if args.out and rows:
        meta = {"git_sha": args.git_sha or "unknown",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                **env, "command": (f"python3 benchmarks/rl_memory.py --model {args.model} "
                                   f"--systems {' '.join(args.systems)} --steps {args.steps} "
                                   f"--batch {args.batch} --tokens {args.tokens} "
                                   "--gpu-memory-utilization "
                                   f"{args.gpu_memory_utilization}")}
        # The file's other parts (the accuracy runs) are kept.
        update_results(Path(args.out), part=f"{args.model}-memory", meta=meta, rows=rows)
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
