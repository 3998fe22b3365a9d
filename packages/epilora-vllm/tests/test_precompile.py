"""EPILORA_VLLM_PRECOMPILE without a GPU: a case's job runs the layer's computation at every
batch size in a background thread inside `epilora_kernels.compile_only`, once per case; a
failing job says why and raises nothing; `EpiloraForward.warm` takes each size's path on the
activations the layer's mode gives it. That the engine's capture then compiles nothing is for
the H200 (test_plugin_gpu.py, and the serving benchmark's graph-capture time); on by default."""

import contextlib
import logging
import threading
from importlib.metadata import PackageNotFoundError
from types import SimpleNamespace

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import _launchers
from epilora_vllm import precompile
from epilora_vllm.forward import EpiloraForward, _Mode


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    # Each test a process's first start: no job yet, no record.
    monkeypatch.setattr(precompile, "_jobs", {})
    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path))


class _Recorder:
    def __init__(self, fail_at: int | None = None, kernels: dict | None = None):
        self.layer = SimpleNamespace(device=torch.device("cpu"))
        self.calls = []
        self.fail_at = fail_at
        self.kernels = kernels  # size -> the kernel it launches (counted compiles), or None

    def warm(self, sizes: tuple[int, ...], after=None) -> None:
        for tokens in sizes:  # as EpiloraForward.warm: one size after another
            self.calls.append((tokens, threading.current_thread().name,
                               _launchers.compiling_only()))
            if tokens == self.fail_at:
                raise RuntimeError("no such kernel")
            if self.kernels is not None:
                _Counted.met.add(self.kernels[tokens])
            if after is not None:
                after(tokens)


class _Counted:
    """compile_only with counted compiles (threads of its own) without a GPU: `variants`, the
    distinct kernels the recorders met in this block."""

    met: set = set()

    @property
    def variants(self) -> int:
        return len(_Counted.met)

    @staticmethod
    @contextlib.contextmanager
    def compile_only(threads: int = 1):
        _Counted.met = set()
        with _launchers.compile_only(threads=1):
            yield _Counted()


def test_a_case_compiles_every_size_once_in_a_background_thread():
    forward, other, third = _Recorder(), _Recorder(), _Recorder()
    job = precompile.start(forward, ("case", 1), (1, 2, 4, 512))
    assert precompile.start(other, ("case", 1), (1, 2, 4, 512)) is job  # a layer of the case
    precompile.start(third, ("case", 3), (8,))
    precompile.wait_all()  # every case's job (a layer's first forward)
    assert job.done() and job.result() is None
    assert [tokens for tokens, _, _ in forward.calls] == [1, 2, 4, 512]
    assert all(name == "epilora-precompile" and only for _, name, only in forward.calls)
    assert threading.current_thread().name != "epilora-precompile"
    assert other.calls == [] and [tokens for tokens, _, _ in third.calls] == [8]
    assert not _launchers.compiling_only()  # this thread launches


def test_a_finished_job_lets_go_of_its_layer():
    # The jobs outlive the engine; its layers (weights, adapter buffers) must not.
    import gc
    import weakref

    forward = _Recorder()
    precompile.start(forward, ("case", 4), (1, 2))
    held = weakref.ref(forward)
    del forward
    precompile.wait_all()
    gc.collect()
    assert held() is None


def test_a_failing_job_says_why_and_leaves_the_rest_to_the_forward(caplog):
    forward = _Recorder(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        assert precompile.start(forward, ("case", 2), (1, 2, 4)).result(timeout=60) is None
    assert [tokens for tokens, _, _ in forward.calls] == [1, 2]  # none after the failure
    assert "RuntimeError: no such kernel" in caplog.text


_write_record = precompile._write_record


def test_a_later_start_runs_only_the_sizes_that_met_new_kernels_under_the_same_settings(
        monkeypatch, tmp_path, caplog):
    settings = ["cpu", "tuned once"]  # the launch settings in force, as _settings names them
    monkeypatch.setattr(precompile, "_settings", lambda device: settings)
    monkeypatch.setattr(precompile.ek, "compile_only", _Counted.compile_only)
    kernels = {1: "k-1", 2: "k-small", 3: "k-small", 4: "k-4"}  # 3 meets 2's kernel
    first, failing = _Recorder(kernels=kernels), _Recorder(fail_at=2, kernels=kernels)
    precompile.start(first, ("case", 1), (1, 2, 3, 4))
    precompile.start(failing, ("case", 2), (1, 2))
    settings[1] = "tuned twice"  # a later case tuned after these jobs were queued
    precompile.wait_all()
    records = list(tmp_path.glob("vllm/precompiled/*.json"))
    assert len(records) == 1  # the failed job is not recorded: the next start runs it whole
    writes = []
    monkeypatch.setattr(precompile, "_write_record", writes.append)
    precompile.wait_all()  # every layer's first forward waits: recorded once
    assert writes == []
    monkeypatch.setattr(precompile, "_write_record", _write_record)

    def later_start(sizes=(1, 2, 3, 4)) -> tuple[_Recorder, _Recorder]:
        monkeypatch.setattr(precompile, "_jobs", {})  # a new process, the same caches
        again, retried = _Recorder(kernels=kernels), _Recorder(kernels=kernels)
        with caplog.at_level(logging.INFO, logger="vllm.epilora_vllm"):
            precompile.start(again, ("case", 1), sizes)
            precompile.start(retried, ("case", 2), (1, 2))
            precompile.wait_all()
        return again, retried

    again, retried = later_start()
    assert [tokens for tokens, _, _ in again.calls] == [1, 2, 4]  # each kernel met once
    assert "an earlier start's record" in caplog.text
    assert [tokens for tokens, _, _ in retried.calls] == [1, 2]
    settings[1] = "tuned thrice"  # a case tuned since: other settings, other kernels
    again, _ = later_start()
    assert [tokens for tokens, _, _ in again.calls] == [1, 2, 3, 4]
    again, _ = later_start(sizes=(1, 2, 3, 4, 5))  # other sizes: other kernels
    assert [tokens for tokens, _, _ in again.calls] == [1, 2, 3, 4, 5]


def test_a_record_stands_on_its_own_when_another_case_shares_its_kernels(monkeypatch):
    # o and down's jobs meet one kernel; a later start serving down alone still loads it.
    monkeypatch.setattr(precompile, "_settings", lambda device: ["cpu"])
    monkeypatch.setattr(precompile.ek, "compile_only", _Counted.compile_only)
    shared = {1: "shared", 2: "own"}
    precompile.start(_Recorder(kernels=shared), ("o", 1), (1, 2))
    precompile.start(_Recorder(kernels=shared), ("down", 1), (1, 2))
    precompile.wait_all()
    monkeypatch.setattr(precompile, "_jobs", {})
    down = _Recorder(kernels=shared)
    precompile.start(down, ("down", 1), (1, 2))
    precompile.wait_all()
    assert [tokens for tokens, _, _ in down.calls] == [1, 2]


def test_a_record_of_no_new_kernel_runs_nothing(monkeypatch):
    monkeypatch.setattr(precompile, "_settings", lambda device: ["cpu"])
    forward = _Recorder()
    path = precompile._record_path(forward, ("case", 6), (1, 2))
    path.parent.mkdir(parents=True)
    path.write_text('{"new_kernels": []}')
    assert precompile.start(forward, ("case", 6), (1, 2)).result(timeout=60) is None
    assert forward.calls == []


def test_an_unreadable_record_is_said_and_every_size_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(precompile, "_settings", lambda device: ["cpu"])
    forward = _Recorder()
    path = precompile._record_path(forward, ("case", 4), (1, 2))
    path.parent.mkdir(parents=True)
    path.write_text('{"new_kernels": [1, 7]}')  # a size the job does not have
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        precompile.start(forward, ("case", 4), (1, 2)).result(timeout=60)
    assert [tokens for tokens, _, _ in forward.calls] == [1, 2]
    assert "is not usable" in caplog.text


def test_a_record_that_cannot_be_named_is_said_and_the_start_goes_on(monkeypatch, caplog):
    def no_version(name):
        raise PackageNotFoundError(name)  # Triton as pytorch-triton, say

    monkeypatch.setattr(precompile, "version", no_version)
    forward = _Recorder()
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        precompile.start(forward, ("case", 5), (1, 2)).result(timeout=60)
        precompile.wait_all()
    assert [tokens for tokens, _, _ in forward.calls] == [1, 2]
    assert "no record of ('case', 5)" in caplog.text


@pytest.mark.parametrize(("quantize", "path", "want"), [
    ("codes", None, ("decode", "none", "torch.float8_e4m3fn")),
    ("vllm", None, ("decode", "bf16", "torch.float8_e4m3fn")),
    ("kernels", None, ("decode", "bf16", "none")),
    ("kernels", "fused", ("fused", "bf16", "none")),
    ("kernels", "hybrid", None),  # its base GEMM is vLLM's: nothing of ours to compile
])
def test_warm_takes_the_batchs_path_on_the_modes_activations(monkeypatch, quantize, path, want):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' rule on the CPU
    a = (torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16),)
    b = (torch.zeros(4, 1, 32, 16, dtype=torch.bfloat16),)
    forward = EpiloraForward(SimpleNamespace(device=torch.device("cpu"),
                                             base_layer=SimpleNamespace(bias=None)))
    forward.lora = ek.LoraWeights(a, b, (32,))
    forward.mode = _Mode(matched=False, path=path, quantize=quantize)
    runs = []

    def run(path, x, quantized, bias, batch, prefetch="next"):
        assert bias is None and prefetch == "none"  # no budget: the kernel without prefetch
        runs.append((path, "none" if x is None else {torch.bfloat16: "bf16"}[x.dtype],
                     "none" if quantized is None else str(quantized[0].dtype), batch))

    monkeypatch.setattr(forward, "_run", run)
    forward.warm((2, 6))
    if want is None:
        assert runs == []
        return
    assert [run[:3] for run in runs] == [want, want]
    # Round robin, as vLLM's dummy adapters; each size the first rows of the largest's.
    assert [batch.token_lora_mapping.tolist() for *_, batch in runs] == [[0, 1],
                                                                          [0, 1, 2, 3, 0, 1]]
    assert [batch.num_tokens for *_, batch in runs] == [2, 6]


def test_with_a_prefetch_budget_warm_compiles_the_kernel_with_and_without_it(monkeypatch):
    # EPILORA_VLLM_PREFETCH_MIB: a layer's decode calls prefetch its next layer's weight, the
    # model's last layer's (and those whose budget is under a line a row) none; the precompile
    # meets both kernels at every size, before any layer knows its next.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    forward = EpiloraForward(SimpleNamespace(device=torch.device("cpu"),
                                             base_layer=SimpleNamespace(bias=None)))
    forward.lora = ek.LoraWeights((torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16),),
                                  (torch.zeros(2, 1, 32, 16, dtype=torch.bfloat16),), (32,))
    forward.mode = _Mode(matched=False, path=None, quantize="codes", prefetch_bytes=1 << 20)
    runs = []
    monkeypatch.setattr(forward, "_run", lambda path, x, q, bias, batch, prefetch="next":
                        runs.append((path, batch.num_tokens, prefetch)))
    forward.warm((2, 6))
    assert runs == [("decode", 2, "stand-in"), ("decode", 2, "none"),
                    ("decode", 6, "stand-in"), ("decode", 6, "none")]


def test_warm_gives_the_kernels_the_bias_vllm_gives_apply(monkeypatch):
    # A biased layer's kernels compile apart (HAS_BIAS): the precompile must meet those, with
    # the bias vLLM 0.26's LoRA forwards pass to apply, and none where they pass none.
    from vllm.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bias = torch.zeros(32, dtype=torch.bfloat16)

    class Column(ColumnParallelLinearWithLoRA):
        def __init__(self, **values):  # no vLLM layer behind it: only what warm reads
            self.__dict__.update(values)

    class Row(RowParallelLinearWithLoRA):
        def __init__(self, **values):
            self.__dict__.update(values)

    cases = [(Column, 0, False, bias), (Column, 1, False, bias), (Column, 0, True, None),
             (Row, 0, False, bias), (Row, 1, False, None), (Row, 0, True, None)]
    for kind, rank, skip, want in cases:
        layer = kind(device=torch.device("cpu"), tp_rank=rank,
                     base_layer=SimpleNamespace(bias=bias, skip_bias_add=skip))
        forward = EpiloraForward(layer)
        forward.lora = ek.LoraWeights((torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16),),
                                      (torch.zeros(2, 1, 32, 16, dtype=torch.bfloat16),), (32,))
        forward.mode = _Mode(matched=False, path=None, quantize="codes")
        given = []
        monkeypatch.setattr(forward, "_run",
                            lambda path, x, q, bias, batch, prefetch="next", given=given:
                            given.append(bias))
        forward.warm((2, 4))
        assert len(given) == 2 and all(b is want for b in given), (kind.__name__, rank, skip)


def test_eager_sizes_stand_for_every_size_above_the_graphs():
    assert precompile.eager_sizes(512, 512) == ()
    assert precompile.eager_sizes(512, 600) == (527, 528, 543, 544, 559, 560, 575, 576, 591,
                                                 592, 600)
    for above, most in ((512, 1000), (500, 1031), (8, 200)):
        sizes = precompile.eager_sizes(above, most)
        assert all(above < size <= most for size in sizes) and sizes == tuple(sorted(sizes))
        # Each size above the graphs has one of them with its 16-row tiles and 16-divisibility.
        for tokens in range(above + 1, most + 1):
            assert tokens == most or any(
                -(-size // 16) == -(-tokens // 16) and (size % 16 == 0) == (tokens % 16 == 0)
                for size in sizes), tokens


@pytest.mark.parametrize(("variable", "reader"), [("EPILORA_VLLM_PRECOMPILE", "precompile"),
                                                  ("EPILORA_VLLM_TUNE", "tune")])
@pytest.mark.parametrize(("value", "want"), [(None, True), ("1", True), ("0", False),
                                             ("yes", ValueError)])
def test_precompile_and_tuning_are_on_by_default_and_their_variables_checked(
        variable, reader, value, want, monkeypatch):
    from epilora_vllm import _env

    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    if want is ValueError:
        with pytest.raises(ValueError, match=f"{variable}='yes'"):
            getattr(_env, reader)()
    else:
        assert getattr(_env, reader)() is want
