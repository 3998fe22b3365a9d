"""Bad adapters of each kind a tenant might bring, for the adapter check's tests (direct and
through the server)."""

import torch

from epilora_testing.tiny_models import write_lora_adapter

RANK, MAX_RANK = 8, 16
BAD = ["rank_above_max", "no_config", "config_not_json", "nan", "inf", "another_base_model",
       "too_many_layers", "truncated", "corrupt"]


def base_config(base_dir):
    """The transformers config of the checkpoint in `base_dir` (vLLM's `hf_config` is one)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(base_dir)


def good_adapter(directory, base_dir, *, rank=RANK, **kw):
    """A rank-`rank` adapter for the checkpoint in `base_dir`, written in `directory`."""
    return write_lora_adapter(directory, base_dir, rank=rank, seed=3, **kw)


def bad_adapter(kind, directory, base_dir, config, *, max_rank=MAX_RANK):
    """An adapter of the bad `kind` (one of BAD) in `directory`, and the words its refusal
    must hold; `config`: the base model's config (attributes)."""
    a_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if kind == "rank_above_max":
        return good_adapter(directory, base_dir, rank=2 * max_rank), f"rank {2 * max_rank} is above"
    if kind in ("nan", "inf"):
        bad = torch.full((RANK, config.hidden_size), float(kind), dtype=torch.bfloat16)
        return good_adapter(directory, base_dir, overrides={a_name: bad}), "holds NaN or Inf"
    if kind == "another_base_model":  # a wider model's adapter
        wide = torch.zeros(RANK, config.hidden_size * 2, dtype=torch.bfloat16)
        return good_adapter(directory, base_dir, overrides={a_name: wide}), "another base model"
    if kind == "too_many_layers":
        name = (f"base_model.model.model.layers.{config.num_hidden_layers}.mlp.up_proj."
                "lora_A.weight")
        extra = torch.zeros(RANK, config.hidden_size, dtype=torch.bfloat16)
        return good_adapter(directory, base_dir, overrides={name: extra}), "names no layer"
    path = good_adapter(directory, base_dir)
    weights = path / "adapter_model.safetensors"
    if kind == "no_config":
        (path / "adapter_config.json").unlink()
        return path, "no adapter_config.json"
    if kind == "config_not_json":
        (path / "adapter_config.json").write_text("{r: 8")
        return path, "not a PEFT LoRA config"
    if kind == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "corrupt":  # not safetensors at all
        weights.write_bytes(b"\x00garbage" * 64)
    else:
        raise ValueError(kind)
    return path, "not a readable safetensors file"
