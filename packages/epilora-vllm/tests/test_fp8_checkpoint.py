"""`write_fp8_checkpoint` on a checkpoint with linears besides the decoder projections: the
projections in FP8 with their scales, every other 2-D weight left bf16 and named in the
config's `ignore`, as vLLM's compressed-tensors loader reads it."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
    should_ignore_layer,
)

from epilora_vllm import write_fp8_checkpoint


def test_linears_left_in_bf16_are_named_in_ignore(tmp_path):
    src = tmp_path / "bf16"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    weights = {"model.embed_tokens.weight": torch.randn(32, 16),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
               "model.layers.0.mlp.gate.weight": torch.randn(4, 16),  # the MoE router
               "model.layers.0.input_layernorm.weight": torch.ones(16)}
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, src / "model.safetensors")
    dst = write_fp8_checkpoint(src, tmp_path / "fp8", progress=False)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale"] == torch.float32
    assert dtypes["model.layers.0.mlp.gate.weight"] == torch.bfloat16
    ignore = json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
    assert should_ignore_layer("model.layers.0.mlp.gate", ignore)  # vLLM's own test
    assert should_ignore_layer("lm_head", ignore)
    assert not should_ignore_layer("model.layers.0.self_attn.q_proj", ignore)
