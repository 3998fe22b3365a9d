"""The inputs every multi-adapter kernel takes, without vLLM: which token uses which adapter, and
the adapters' weights, in vLLM's own layouts so the plugin can pass vLLM's buffers unchanged.

`AdapterBatch` holds the same tensors as vLLM's `LoRAKernelMeta.meta_args()` (Punica metadata):
tokens sorted by adapter slot, and per active slot its token count and start. `LoraWeights` holds
vLLM's stacked adapter buffers, one tensor per output slice (q, k, v or gate, up).
"""

from dataclasses import dataclass

import torch

MAX_SLICES = 3  # qkv; gate_up has 2, o and down 1


@dataclass(frozen=True)
class AdapterBatch:
    """Which adapter slot each token uses (-1: none), grouped by slot.

    Attributes:
        token_lora_mapping: `[T]` int32, the slot of each token, -1 for no adapter.
        sorted_token_indices: `[T]` int32, token indices stably sorted by slot.
        lora_ids: `[max_loras + 1]` int32, the active slots in ascending order (-1 first when some
            token has no adapter), padded with -1.
        num_tokens_per_lora: `[max_loras + 1]` int32, tokens per entry of `lora_ids`.
        lora_token_start: `[max_loras + 2]` int32, where each entry's tokens start in
            `sorted_token_indices` (exclusive prefix sum of the counts).
    """

    token_lora_mapping: torch.Tensor
    sorted_token_indices: torch.Tensor
    lora_ids: torch.Tensor
    num_tokens_per_lora: torch.Tensor
    lora_token_start: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_lora_mapping.shape[0]

    @property
    def max_loras(self) -> int:
        return self.lora_ids.shape[0] - 1

    @property
    def num_entries(self) -> int:
        """Entries of `lora_ids` (max_loras + 1: the slots and tokens without an adapter)."""
        return self.lora_ids.shape[0]

    @classmethod
    def from_token_mapping(cls, token_lora_mapping: torch.Tensor, max_loras: int) -> "AdapterBatch":
        """Build the metadata as vLLM's `LoRAKernelMeta.prepare_tensors` does (host sync)."""
        mapping = token_lora_mapping.to(torch.int32).contiguous()  # as check_batch wants it
        if mapping.ndim != 1:
            raise ValueError(f"token_lora_mapping must be 1-D, got shape {tuple(mapping.shape)}")
        if mapping.numel() and (int(mapping.min()) < -1 or int(mapping.max()) >= max_loras):
            raise ValueError(
                f"token_lora_mapping values must be in [-1, {max_loras - 1}] (slots of "
                f"max_loras={max_loras}), got [{int(mapping.min())}, {int(mapping.max())}]"
            )
        device = mapping.device
        sorted_indices = torch.sort(mapping, stable=True).indices.to(torch.int32)
        ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
        lora_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32, device=device)
        num_tokens = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        lora_ids[: ids.numel()] = ids.to(torch.int32)
        num_tokens[: counts.numel()] = counts.to(torch.int32)
        start = torch.zeros(max_loras + 2, dtype=torch.int32, device=device)
        start[1:] = torch.cumsum(num_tokens, 0)
        return cls(mapping, sorted_indices, lora_ids, num_tokens, start)

    def vllm_meta_args(self) -> tuple:
        """The seven metadata arguments of vLLM's Punica kernels (`lora_shrink`, `lora_expand`),
        in `LoRAKernelMeta.meta_args` order, with the no-LoRA flag and the grid's adapter count
        (max_loras + 1, vLLM's default) as CPU tensors."""
        no_lora = torch.tensor([bool((self.token_lora_mapping == -1).all())])
        num_active = torch.tensor([self.max_loras + 1], dtype=torch.int32)
        return (self.token_lora_mapping, self.sorted_token_indices, self.num_tokens_per_lora,
                self.lora_token_start, self.lora_ids, no_lora, num_active)

    @classmethod
    def from_vllm_meta_args(cls, meta_args: tuple) -> "AdapterBatch":
        """From the first five entries of vLLM's `LoRAKernelMeta.meta_args(T, ...)`."""
        mapping, sorted_indices, num_tokens, start, lora_ids = meta_args[:5]
        return cls(mapping, sorted_indices, lora_ids, num_tokens, start)


@dataclass(frozen=True)
class LoraWeights:
    """vLLM's stacked adapter buffers for one projection, one tensor per output slice.

    Attributes:
        lora_a: per slice `[max_loras, 1, max_rank, K]` (PEFT `lora_A.weight`, zero-padded rows).
        lora_b: per slice `[max_loras, 1, N_s, max_rank]` (PEFT `lora_B.weight` with the
            alpha / r scaling folded in, zero-padded columns).
        output_slices: N_s of each slice; the projection's output is their concatenation.
    """

    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]
    output_slices: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.output_slices)
        if not 1 <= n <= MAX_SLICES or len(self.lora_a) != n or len(self.lora_b) != n:
            raise ValueError(
                f"need 1..{MAX_SLICES} slices with one lora_a and one lora_b each, got "
                f"{len(self.lora_a)} A, {len(self.lora_b)} B, output_slices={self.output_slices}"
            )
        first = self.lora_a[0]
        for s, (a, b, width) in enumerate(zip(self.lora_a, self.lora_b, self.output_slices,
                                              strict=True)):
            if a.ndim != 4 or b.ndim != 4 or a.shape[1] != 1 or b.shape[1] != 1:
                raise ValueError(f"slice {s}: lora_a/lora_b must be [L, 1, ., .], got "
                                 f"{tuple(a.shape)} and {tuple(b.shape)}")
            if a.shape[0] != first.shape[0] or a.shape[2:] != first.shape[2:]:
                raise ValueError(f"slice {s}: lora_a shape {tuple(a.shape)} differs from slice 0 "
                                 f"{tuple(first.shape)}")
            if b.shape[0] != a.shape[0] or b.shape[2] != width or b.shape[3] != a.shape[2]:
                raise ValueError(f"slice {s}: lora_b shape {tuple(b.shape)} does not match "
                                 f"[{a.shape[0]}, 1, {width}, {a.shape[2]}]")
            if not (a.is_contiguous() and b.is_contiguous()):
                raise ValueError(f"slice {s}: lora_a and lora_b must be contiguous")

    @property
    def max_loras(self) -> int:
        return self.lora_a[0].shape[0]

    @property
    def max_rank(self) -> int:
        return self.lora_a[0].shape[2]

    @property
    def in_features(self) -> int:
        return self.lora_a[0].shape[3]

    @property
    def out_features(self) -> int:
        return sum(self.output_slices)
