"""The plugin's views of vLLM's LoRA metadata (`forward._batch_view`): made once per metadata
object and token count, filled by vLLM in place between steps, new when vLLM replaces them."""

import torch
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

from epilora_vllm import forward


def test_one_view_per_token_count_that_sees_each_steps_metadata():
    meta = LoRAKernelMeta.make(4, 64, "cpu")
    meta.prepare_tensors(torch.tensor([2, 0, 2, 1, -1, 0], dtype=torch.int32))
    view = forward._batch_view(meta, 6)
    assert forward._batch_view(meta, 6) is view
    assert view.num_tokens == 6 and view.max_loras == 4
    assert view.token_lora_mapping.tolist() == [2, 0, 2, 1, -1, 0]
    meta.prepare_tensors(torch.tensor([3, 3, 1, 1, 1, 0], dtype=torch.int32))  # the next step
    assert forward._batch_view(meta, 6) is view
    assert view.token_lora_mapping.tolist() == [3, 3, 1, 1, 1, 0]
    assert view.num_tokens_per_lora[:3].tolist() == [1, 3, 2]  # slots 0, 1, 3
    assert forward._batch_view(meta, 4).num_tokens == 4


def test_a_new_view_when_vllm_replaces_its_tensors():
    meta = LoRAKernelMeta.make(2, 16, "cpu")
    meta.prepare_tensors(torch.tensor([0, 1], dtype=torch.int32))
    view = forward._batch_view(meta, 2)
    meta.active_lora_ids = meta.active_lora_ids.clone()
    again = forward._batch_view(meta, 2)
    assert again is not view and again.lora_ids is meta.active_lora_ids
