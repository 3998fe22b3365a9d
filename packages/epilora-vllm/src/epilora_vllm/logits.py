"""The LM head's LoRA: vLLM's own class, without its two Punica kernels while no adapter slot
holds lm_head weights.

vLLM wraps the logits processor for LoRA in every model that lists `lm_head` among its embedding
modules (Llama, Qwen3, ...) and at every step runs its Punica shrink and expand over the whole
vocabulary, for adapters without lm_head weights too: their slots hold zeros, which add +0.0 to
every logit. With the plugin serving the decoder's projections these are the step's only Punica
launches, at each step's number of requests: batch sizes vLLM's warm-up never ran them at (its
sampler warm-up runs one, `max_num_seqs`), so each new size compiled Triton kernels while
serving (vLLM's JIT monitor: `_lora_shrink_kernel` and `_lora_expand_kernel` at the first
requests of the online benchmark at d796919), and each step reads B over the vocabulary for
every adapter in the batch.

`EpiloraLogitsProcessorWithLoRA` keeps vLLM's buffers, adapter loading and arithmetic, and
skips the two kernels while no slot was set with a non-zero lm_head B (vLLM's dummy warm-up
adapters set zeros; adapters without lm_head weights reset their slot): the logits are then
those vLLM computes, bit for bit (x + 0.0 is x). An adapter with lm_head weights turns the
kernels back on. The logits processor runs outside vLLM's CUDA graphs (after the model's
forward, eagerly), so the choice is made at each call; inside a graph capture it never skips.
"""

import torch
from vllm.lora.layers import LogitsProcessorWithLoRA


class _AddsNothing:
    """A Punica wrapper whose `add_lora_logits` adds no adapter (every B is zero)."""

    @staticmethod
    def add_lora_logits(y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return y


class EpiloraLogitsProcessorWithLoRA(LogitsProcessorWithLoRA):
    """vLLM's LogitsProcessorWithLoRA; `slots_with_weights`: the slots set with a non-zero B."""

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        super().create_lora_weights(max_loras, lora_config, model_config)
        self.slots_with_weights: set[int] = set()

    def reset_lora(self, index: int) -> None:
        super().reset_lora(index)
        self.slots_with_weights.discard(index)

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        super().set_lora(index, lora_a, lora_b)  # resets the slot first
        if bool(lora_b.any()):  # the adapter's own tensor (vLLM's CPU copy): no GPU sync
            self.slots_with_weights.add(index)

    def _get_logits(self, hidden_states: torch.Tensor, lm_head,
                    embedding_bias: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.slots_with_weights or (hidden_states.is_cuda
                                       and torch.cuda.is_current_stream_capturing()):
            return super()._get_logits(hidden_states, lm_head, embedding_bias)
        # vLLM's own computation, its Punica wrapper swapped for one that adds nothing.
        wrapper = self.punica_wrapper
        self.punica_wrapper = _AddsNothing()
        try:
            return super()._get_logits(hidden_states, lm_head, embedding_bias)
        finally:
            self.punica_wrapper = wrapper


def from_layer_logits_processor(layer, lm_head, max_loras: int, lora_config,
                                model_config=None) -> EpiloraLogitsProcessorWithLoRA:
    """`vllm.lora.utils.from_layer_logits_processor` (vLLM 0.26's, line for line: keep in
    step with it), building the class above."""
    wrapped = EpiloraLogitsProcessorWithLoRA(layer, lm_head.embedding_dim, lm_head.weight.dtype,
                                             lm_head.weight.device,
                                             lm_head.get_sharded_to_full_mapping())
    wrapped.create_lora_weights(max_loras, lora_config, model_config)
    return wrapped
