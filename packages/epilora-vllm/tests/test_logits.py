"""The LM head's LoRA class (`epilora_vllm.logits`): vLLM's arithmetic, whose Punica kernels run
only while some slot was set with a non-zero lm_head B. End to end, the CPU engine builds it
(test_plugin_cpu.py); here its slots and calls, with vLLM's own class and a recording wrapper."""

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

VOCAB, HIDDEN, RANK = 48, 16, 8


class _Punica:
    """Records `add_lora_logits` calls and adds every token's slot-0 delta, as vLLM's would."""

    def __init__(self):
        self.calls = 0

    def add_lora_logits(self, y, x, lora_a, lora_b, scale):
        self.calls += 1
        return y.add_((x @ lora_a[0, 0].T) @ lora_b[0, 0].T * scale)


@pytest.fixture
def head(monkeypatch):
    import vllm.lora.layers.logits_processor as vllm_logits
    from vllm.config.lora import LoRAConfig

    from epilora_vllm.logits import EpiloraLogitsProcessorWithLoRA

    monkeypatch.setattr(vllm_logits, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(vllm_logits, "get_tensor_model_parallel_rank", lambda: 0)
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    base = SimpleNamespace(vocab_size=VOCAB, _gather_logits=lambda logits: logits,
                           _apply_head=lambda lm_head, x, bias: x @ weight.T)
    layer = EpiloraLogitsProcessorWithLoRA(base, HIDDEN, torch.float32, torch.device("cpu"),
                                           None)
    layer.create_lora_weights(2, LoRAConfig(max_lora_rank=RANK, max_loras=2,
                                            lora_dtype=torch.float32))
    layer.set_mapping(_Punica())
    return layer, weight


def test_no_punica_kernels_until_a_slot_has_lm_head_weights(head):
    layer, weight = head
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    # vLLM's dummy warm-up adapters: zeros.
    layer.set_lora(0, torch.zeros(RANK, HIDDEN), torch.zeros(VOCAB, RANK))
    assert layer.slots_with_weights == set()
    assert torch.equal(layer._get_logits(x, None), x @ weight.T)
    assert layer.punica_wrapper.calls == 0

    a, b = torch.ones(RANK, HIDDEN), torch.full((VOCAB, RANK), 0.5)
    layer.set_lora(0, a, b)  # an adapter with lm_head weights
    assert layer.slots_with_weights == {0}
    assert torch.allclose(layer._get_logits(x, None), x @ weight.T + (x @ a.T) @ b.T)
    assert layer.punica_wrapper.calls == 1

    layer.reset_lora(0)  # the slot goes to an adapter without them
    assert layer.slots_with_weights == set()
    assert torch.equal(layer._get_logits(x, None), x @ weight.T)
    assert layer.punica_wrapper.calls == 1
    assert isinstance(layer.punica_wrapper, _Punica)  # the real wrapper is back after a skip
