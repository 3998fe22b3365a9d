"""`LoraProjection`: one projection's FP8 weight and adapters, checked and bound once; a call
per batch.

`lora_linear` is given the weight and the adapters at every call: it checks them, derives its
launch settings' key from every argument and fills every kernel argument, tens of microseconds
of host time a call. An engine's eager prefill steps make hundreds of calls, and there that time
is most of the step's (docs/plugin.md, "Status"). An engine calls each projection with the same
weight and adapter buffers for its whole life (vLLM copies adapters into fixed buffers), so a
`LoraProjection` checks those once and binds them into the kernels' launch templates
(`_fast_launch.Template.bind`). A call then checks and derives only what comes with it: the
activations or codes, the batch, and the token count. The launch settings of a token count are
shared by every projection of the same shapes, so a step of a count never seen before derives
them once per shape, not once per layer.

It computes what `lora_linear` computes given the same arguments, with the same launch settings
and kernels, hence the same bits. The decode, fused and W8A16 paths take the bound launch; the
hybrid path and empty batches go through `lora_linear`. The tensors given at construction must
keep their storage: an engine that replaces or moves a weight makes a new projection. The launch
tables a projection reads are those of its construction (EPILORA_LAUNCH_TABLES read then, as
EPILORA_DECODE_AFTER_PREVIOUS, EPILORA_DECODE_ONE_LAUNCH, EPILORA_DELTA_KERNEL and
EPILORA_EPILOGUE_EARLY: not read again at every call);
settings a tuner writes later reach it through `launch.clear_table_cache`, as they reach
`lora_linear`.
"""

import itertools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from epilora_kernels import _checks, _env, _launchers, _tiling, fused
from epilora_kernels._launchers import FP8, W8A16
from epilora_kernels.arch import UnsupportedError, device_support
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_kernels.dispatch import PATHS, _supports_on, choose_path, lora_linear
from epilora_kernels.prefetch import L2Prefetch, kernel_args
from epilora_kernels.workspace import Workspace, default_workspace, normalized_device

_BOUND_PATHS = ("decode", "fused", "w8a16")


class _Step:
    """What a call of one path, shapes and token count launches, tensors aside: shared by every
    projection of those shapes (`_STEPS`)."""

    __slots__ = ("k1", "k2", "grid1", "grid2", "partial_shape", "tiles", "cfg1", "block_a",
                 "a_sorted", "h_dtype", "quantize", "cfg2", "prefetch", "delta_in_y")

    def __init__(self, **values) -> None:
        for name, value in values.items():
            setattr(self, name, value)


# Each call's `_Step` by (the projection's shapes, interned; path; tokens; strides; entries;
# what the caller quantized): a step's token count is met by every layer of a shape, and derived
# once. Emptied with the launch settings it comes from (`launch.clear_table_cache`).
_STEPS: dict[tuple, _Step] = {}
_SHAPES: dict[tuple, int] = {}  # a projection's shapes -> their number in _STEPS' keys
_NUMBERS = itertools.count()  # drawn atomically: two threads never get one number
_MAX_STEPS = 1 << 16  # a process calling with ever new token counts starts over past this
_MAX_BOUND = 256  # a projection's bound templates (a few launch settings each in practice)
# The batch last checked, with the device and slots it was checked against: the calls of one
# step (every projection of every layer) share their batch, checked once.
_checked_batch: tuple | None = None


def clear() -> None:
    """Forget the launch settings derived so far (`launch.clear_table_cache`)."""
    _STEPS.clear()


class LoraProjection:
    """A projection's FP8 `weight` `[N, K]` with its `weight_scale` and adapters `lora`, as
    `lora_linear` takes them, checked once; calling it computes `lora_linear(x, weight,
    weight_scale, lora, batch, ..., prefetch=prefetch)`. `workspace`: the counters its
    launches use (default: the device's default workspace at each call,
    `set_default_workspace`). `prefetch`: an `L2Prefetch` of the weight the caller's next
    projection reads, which the decode path's GEMM pulls into L2."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, lora: LoraWeights, *,
                 workspace: Workspace | None = None, prefetch: L2Prefetch | None = None
                 ) -> None:
        if not isinstance(weight, torch.Tensor) or not isinstance(weight_scale, torch.Tensor):
            raise ValueError("weight and weight_scale must be tensors")
        device = weight.device
        _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features, device)
        _checks.check_lora(lora, None, device)
        self.device = normalized_device(device)
        if workspace is not None and workspace.device != self.device:
            raise ValueError(f"the workspace is on {workspace.device}, the weight on {device}")
        self.weight, self.weight_scale, self.lora, self.workspace = (weight, weight_scale, lora,
                                                                     workspace)
        self.prefetch = prefetch
        self._prefetch_args = kernel_args(prefetch, self.device)
        self._after_previous = _env.decode_after_previous()
        self._one_launch = _env.decode_one_launch()
        self._delta_kernel = _env.delta_kernel()
        self._epilogue_early = _env.epilogue_early()  # (its K2 templates' key, _STEPS')
        self._support = support = device_support(device)
        slices = tuple(lora.output_slices)
        self._supported = {path: _supports_on(support, path, lora.in_features, slices,
                                              lora.max_rank, weight.dtype, weight_scale.numel())
                           for path in PATHS}
        shapes = (support, _tiling.table_of(support), tuple(weight.shape), weight.stride(),
                  weight.data_ptr() % 16, weight_scale.numel(), slices, lora.max_rank)
        self._shapes = _SHAPES.get(shapes)
        if self._shapes is None:
            self._shapes = _SHAPES.setdefault(shapes, next(_NUMBERS))
        self._bound: dict = {}  # a shared template -> this projection's binding of it
        a, b, _, _ = _launchers._slices(lora)
        self._k1_tensors = dict(a0_ptr=a[0], a1_ptr=a[1], a2_ptr=a[2])
        self._b = b

    def __call__(self, x: torch.Tensor | None, batch: AdapterBatch, *, path: str | None = None,
                 base_gemm=None,
                 x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 `[T, N]`: `lora_linear(x, weight, weight_scale, lora, batch, path=path,
        base_gemm=base_gemm, x_quantized=x_quantized, bias=bias)` with this projection's
        tensors."""
        rows = x if x is not None else x_quantized[0] if x_quantized is not None else None
        if (path is None and isinstance(rows, torch.Tensor) and rows.ndim == 2
                and isinstance(batch, AdapterBatch)):
            path = choose_path(rows.shape[0], batch, self._support, self.lora,
                               codes=x_quantized is not None)
        if path not in _BOUND_PATHS or not isinstance(rows, torch.Tensor) or rows.ndim != 2 \
                or rows.shape[0] == 0 or (x is None and path == "w8a16"):
            # lora_linear's own checks and paths (and its errors, for every bad input)
            return lora_linear(x, self.weight, self.weight_scale, self.lora, batch, path=path,
                               workspace=self.workspace, base_gemm=base_gemm,
                               x_quantized=x_quantized, bias=bias, prefetch=self.prefetch)
        ok = self._supported[path]
        if not ok:
            raise UnsupportedError(f"{path} path: {ok.reason}")
        _checks.check_bias(bias, self.lora.out_features, self.device)
        return self._launch(path, x, x_quantized, batch, bias)

    # -- the bound launch ----------------------------------------------------------------------

    def _check(self, path: str, x, x_quantized, batch: AdapterBatch) -> torch.Tensor:
        # `fused._linear`'s checks of what comes with a call (the weight and adapters were
        # checked at construction); the rows K1 reads.
        k = self.lora.in_features
        if x is None:
            codes, scales = x_quantized
            _checks.check_codes(codes, scales, k)
            rows = codes
        else:
            _checks.check_activations(x)
            if x.shape[1] != k:
                raise ValueError(f"x has {x.shape[1]} features, the adapters take {k}")
            if x_quantized is not None:
                if path == "w8a16":
                    raise ValueError("the w8a16 path computes on bf16 activations: x_quantized "
                                     "is for the FP8 paths")
                _checks.check_codes_beside(x, *x_quantized)
            rows = x
        if rows.device != self.device:
            raise ValueError(f"x is on {rows.device}, the weight on {self.device}")
        global _checked_batch
        if batch.num_tokens != rows.shape[0]:
            raise ValueError(f"batch maps {batch.num_tokens} tokens, x has {rows.shape[0]}")
        checked = _checked_batch
        if (checked is None or checked[0] is not batch or checked[1] != self.device
                or checked[2] != self.lora.max_loras):
            _checks.check_batch(batch, rows.shape[0], self.device, self.lora.max_loras)
            _checked_batch = (batch, self.device, self.lora.max_loras)
        return rows

    def _step(self, path: str, x, x_quantized, batch: AdapterBatch, biased: bool) -> _Step:
        # `fused._linear`'s settings for this call (`fused._plan`), its templates and grids.
        rows = x if x is not None else x_quantized[0]
        t = rows.shape[0]
        prefetch = self._prefetch_args if path == "decode" else None
        after_previous = path == "decode" and self._after_previous
        key = (self._shapes, path, t, -1 if x is None else x.stride(0),
               -1 if x_quantized is None else x_quantized[0].stride(0), batch.num_entries,
               biased, prefetch, after_previous, self._one_launch, self._delta_kernel,
               self._epilogue_early)
        step = _STEPS.get(key)
        if step is not None:
            return step
        mode, decode, pdl, wait_k1_first = _flags(path, t)
        quantize = mode == FP8 and x_quantized is None
        counted = pdl and quantize and not wait_k1_first
        support, lora = self._support, self.lora
        lead = fused.one_launch(support, mode, t, batch, decode=decode, pdl=pdl,
                                quantize=quantize, prefetch=prefetch, enabled=self._one_launch)
        cfg1, cfg2, tiles, a_sorted, h_dtype = fused._plan(
            support, mode, rows, self.weight, self.weight_scale, lora, batch, None, None,
            decode=decode, quantize=quantize, pdl=pdl, counted=counted,
            warm_l2=fused.DECODE_WARM_L2, wait_k1_first=wait_k1_first, has_bias=biased,
            lead=lead)
        grid2 = _tiling.gemm_grid(mode, t, lora.out_features, cfg2)
        w_tma = _tiling.w_tma(support, self.weight, cfg2)
        # K2's A: K1's codes ([T, K], contiguous), the caller's codes, or (W8A16) x
        stride_a = (lora.in_features if quantize else
                    x_quantized[0].stride(0) if mode == FP8 else x.stride(0))
        if lead:  # one launch: no K1; K2's grid the shrink's programs and then its own
            step = _Step(
                k1=None, k2=_launchers.k2_lead_template(
                    support, lora, batch.num_entries, cfg1, cfg2, stride_a=stride_a,
                    stride_x=rows.stride(0), x_codes=x is None, split=grid2[2], w_tma=w_tma,
                    per_channel=self.weight_scale.numel() > 1, traced=False, has_bias=biased),
                grid1=None, grid2=_launchers.lead_grid(t, lora, batch, cfg1, cfg2),
                partial_shape=(None if grid2[2] == 1 else
                               _launchers.gemm_partial_shape(grid2, lora.out_features, cfg2)),
                tiles=tiles, cfg1=cfg1, cfg2=cfg2, block_a=None, a_sorted=False,
                h_dtype=h_dtype, quantize=False, prefetch=None, delta_in_y=False)
            return _keep_step(key, step)
        k2_pdl = _launchers.use_pdl(support, pdl)
        # EPILORA_DELTA_KERNEL: as `_launchers.launch_k2` decides it
        delta_in_y = _launchers.use_delta_kernel(
            self._delta_kernel, mode, cfg2, batch.num_entries, split=grid2[2], pdl=k2_pdl,
            wait_k1_first=wait_k1_first, tokens=t, rank=lora.max_rank)
        step = _Step(
            k1=_launchers.k1_template(
                support, lora, batch.num_entries, cfg1, stride_x=rows.stride(0),
                quantize=quantize, signal_codes=counted, codes_sorted=a_sorted, pdl=pdl,
                traced=False, h_dtype=h_dtype, x_codes=x is None,
                after_previous=after_previous),
            k2=_launchers.k2_template(
                support, mode, lora, batch.num_entries, cfg2,
                stride_a=stride_a,
                stride_y=lora.out_features, h_planes=1, split=grid2[2], w_tma=w_tma,
                per_channel=self.weight_scale.numel() > 1,
                pdl=k2_pdl, wait_codes=counted,
                warm_l2=fused.DECODE_WARM_L2, traced=False, wait_k1_first=wait_k1_first,
                a_sorted=a_sorted, has_bias=biased, prefetch=prefetch, tokens=t,
                delta_in_y=delta_in_y, early_setting=self._epilogue_early),
            grid1=_launchers.k1_grid(t, lora, batch, cfg1, quantize=quantize), grid2=grid2,
            partial_shape=(None if grid2[2] == 1 else
                           _launchers.gemm_partial_shape(grid2, lora.out_features, cfg2)),
            tiles=tiles, cfg1=cfg1, cfg2=cfg2, block_a=[cfg2.block_m, cfg2.block_k],
            a_sorted=a_sorted, h_dtype=h_dtype, quantize=quantize, prefetch=prefetch,
            delta_in_y=delta_in_y)
        return _keep_step(key, step)

    def _bind(self, template, step: _Step):
        # A shared template with this projection's weight or adapter tensors in its slots.
        if template is step.k1:
            bound = template.bind(**self._k1_tensors)
        else:
            weight, b = self.weight, self._b
            w_operand = _launchers._w_operand(self._support, weight, step.cfg2)
            if step.k1 is None:  # one launch: A for its shrink, no prefetch
                tensors = self._k1_tensors
            else:  # the template prefetches (the decode path's K2) only with this projection's
                tensors = dict(pf_ptr=weight if step.prefetch is None
                               else self.prefetch.bytes_view())
            bound = template.bind(w_ptr=weight, w_desc=w_operand, w_scale_ptr=self.weight_scale,
                                  b0_ptr=b[0], b1_ptr=b[1], b2_ptr=b[2], **tensors)
        if len(self._bound) >= _MAX_BOUND:  # the shared templates were made anew
            self._bound.clear()
        self._bound[template] = bound
        return bound

    def _launch(self, path: str, x, x_quantized, batch: AdapterBatch,
                bias: torch.Tensor | None) -> torch.Tensor:
        rows = self._check(path, x, x_quantized, batch)
        step = self._step(path, x, x_quantized, batch, bias is not None)
        k2 = self._bound.get(step.k2) or self._bind(step.k2, step)
        support, lora, device = self._support, self.lora, self.device
        workspace = self.workspace or default_workspace(device)
        t = rows.shape[0]
        # Everything K2 needs is made before K1 launches (as in fused._linear).
        counters = workspace.counters(step.tiles)
        tile_counters = workspace.tile_counters(counters)
        if step.k1 is None:
            return self._launch_one(k2, step, rows, x, x_quantized, batch, bias, counters,
                                    tile_counters)
        k1 = self._bound.get(step.k1) or self._bind(step.k1, step)
        partials, h, codes, scales = _launchers.k1_buffers(
            t, lora.in_features, lora, step.cfg1, quantize=step.quantize, h_dtype=step.h_dtype,
            device=device)
        y = torch.empty(t, lora.out_features, dtype=torch.bfloat16, device=device)
        if step.quantize:
            a, a_scale = codes, scales
        elif x_quantized is not None:
            a, a_scale = x_quantized
        else:  # W8A16: the bf16 activations (a_scale is not read)
            a, a_scale = x, self.weight_scale
        partial = (y if step.partial_shape is None else
                   torch.empty(step.partial_shape, dtype=torch.float32, device=device))
        a_desc = TensorDescriptor.from_tensor(a, step.block_a) if step.a_sorted else a
        x_scales = x_quantized[1] if x is None else None
        sorted_indices, lora_ids = batch.sorted_token_indices, batch.lora_ids
        _launchers._start_template(support, k1, step.grid1, (
            t, rows, partials if codes is None else codes,
            scales if step.quantize else partials if x_scales is None else x_scales,
            h, partials, sorted_indices, lora_ids, batch.num_tokens_per_lora,
            batch.lora_token_start, tile_counters, counters, counters))
        try:
            if step.delta_in_y:
                _launchers.launch_delta(support, y, h, lora, batch)
            _launchers._start_template(support, k2, step.grid2, (
                t, a, a_desc, a_scale, self.weight_scale if bias is None else bias, y, h,
                sorted_indices, lora_ids, batch.lora_token_start, partial, tile_counters,
                counters, counters))
        except BaseException:
            # As fused._linear: K1's counts must not make the next K2 pass its wait early.
            if not _launchers.compiling_only():
                workspace.reset()
            raise
        return y

    def _launch_one(self, k2, step: _Step, rows, x, x_quantized, batch: AdapterBatch,
                    bias: torch.Tensor | None, counters, tile_counters) -> torch.Tensor:
        # The decode path in one launch (`_launchers.launch_lead`): the shrink reads `rows`
        # (bf16 x, or the codes with their scales), the GEMM the caller's codes.
        lora, device, t = self.lora, self.device, rows.shape[0]
        partials, _, _, _ = _launchers.k1_buffers(t, lora.in_features, lora, step.cfg1,
                                                  quantize=False, h_dtype=torch.float32,
                                                  device=device)
        y = torch.empty(t, lora.out_features, dtype=torch.bfloat16, device=device)
        partial = (y if step.partial_shape is None else
                   torch.empty(step.partial_shape, dtype=torch.float32, device=device))
        codes, scales = x_quantized
        _launchers._start_template(self._support, k2, step.grid2, (
            t, codes, codes, scales, self.weight_scale if bias is None else bias, y, partials,
            batch.sorted_token_indices, batch.lora_ids, batch.lora_token_start, partial,
            tile_counters, counters, counters, rows, scales, batch.num_tokens_per_lora))
        return y


def _keep_step(key: tuple, step: _Step) -> _Step:
    if len(_STEPS) >= _MAX_STEPS:
        _STEPS.clear()
    _STEPS[key] = step
    return step


def _flags(path: str, tokens: int) -> tuple[int, bool, bool, bool]:
    # (K2's mode, decode settings, PDL, K2 waits for all of K1 first) of a path as its function
    # in `fused` launches it with its defaults.
    if path == "decode":
        return FP8, True, True, False
    if path == "fused":
        return FP8, False, fused.fused_pdl(tokens), True
    return W8A16, False, False, False
