"""The plugin on the GPU: the checks of the CPU tests (every call of layer 0's projections
against float64 from the files) with the kernels computing, eagerly; then the same engine in
vLLM's default configuration (torch.compile, CUDA graphs), whose graphs hold the kernels."""

import json

import pytest
import torch
from engine_cases import (
    FUSED,
    MAX_TOKENS,
    PROMPTS,
    assert_equal_up_to_a_near_tie,
    assert_every_call_matches_the_files,
    assert_the_matched_mode_computes_w8a16_without_lora,
    engine,
    generate,
    generate_with_logprobs,
    layer0_projections,
    model_of,
    request,
)

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("name", list(FUSED))
def test_every_call_equals_the_base_plus_each_tokens_adapter_from_its_files(served,
                                                                            checkpoints, name):
    assert type(served["projections"][name]).__name__.startswith("Epilora")
    assert all(y.is_cuda for _, y, _, _ in served["calls"][name])
    assert_every_call_matches_the_files(served, checkpoints, name)


@pytest.fixture(scope="module")
def graphed(checkpoints, served):
    del served  # after the eager engine
    llm = engine(checkpoints["fp8"])
    config = llm.llm_engine.vllm_config.compilation_config
    return llm, config


def test_in_cuda_graphs_adapters_change_answers_and_a_mixed_batch_equals_single_requests(
        graphed, checkpoints, served):
    llm, config = graphed
    assert config.cudagraph_mode.has_full_cudagraphs() or config.cudagraph_mode.name != "NONE"
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    # Alone, a request runs at another batch size than in the mixed batch, whose token bucket
    # the engine-start tuner may have given other K2 settings: equal up to a near tie (as
    # exact equality it failed on an H100 at d405d3a and at 0a09d06, the latter at adapter
    # 2's second token; docs/plugin.md)
    mixed = generate_with_logprobs(llm, requests)
    alone = [generate_with_logprobs(llm, [r])[0] for r in requests]
    assert_equal_up_to_a_near_tie(alone, mixed, "alone against the mixed batch")
    by_adapter = [generate(llm, [(PROMPTS[0], request(checkpoints, i))])[0]
                  for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter
    torch.cuda.synchronize()


# Level 2's failed reload (below, an expected failure) leaves the rotary embedding it reused on
# the meta device; engine_cases.engine gives each engine its own, so the order of the tests
# here does not matter (the matched-mode test, after the sleep tests, failed before that).
def test_timed_dispatch_chooses_per_shape_and_bucket_then_a_later_start_times_nothing(
        checkpoints, tmp_path, monkeypatch):
    # EPILORA_VLLM_DISPATCH=timed in vLLM's default configuration: the warm-up runs before each
    # graph size is captured time the candidates (the kernels' paths and vLLM's own), and the
    # file holds a choice per projection shape and token bucket; adapters change the engine's
    # answers. A second engine reads the file, times nothing and answers the same (the same
    # paths: a batch of another bucket may take another path, so singles need not equal a
    # mixed batch bit for bit here). In EPILORA_VLLM_QUANTIZE=vllm, where every candidate can
    # run (in the default codes mode the hybrid path and vLLM's kernels, which read the bf16
    # activations, are no candidates).
    from epilora_vllm import dispatch

    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EPILORA_VLLM_DISPATCH", "timed")
    monkeypatch.setenv("EPILORA_VLLM_QUANTIZE", "vllm")
    dispatch._dispatchers.clear()
    llm = engine(checkpoints["fp8"])
    files = list((tmp_path / "vllm").glob("dispatch__*.json"))
    assert len(files) == 1
    choices = json.loads(files[0].read_text())
    shapes = {key.split("/")[0] for key in choices}
    assert len(shapes) == 4, shapes  # the tiny model's qkv, o, gate_up and down
    assert all(set(c["us"]) >= {"fused", "hybrid", "vllm"} for c in choices.values())
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    mixed = generate(llm, requests)
    by_adapter = [generate(llm, [(PROMPTS[0], request(checkpoints, i))])[0]
                  for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter
    del llm
    dispatch._dispatchers.clear()
    monkeypatch.setattr(dispatch.TimedDispatch, "_timer",
                        lambda self: pytest.fail("a later start timed a case again"))
    again = engine(checkpoints["fp8"])
    assert generate(again, requests) == mixed


def test_precompile_compiles_our_kernels_before_the_capture_and_a_later_start_on_its_records(
        checkpoints, graphed, monkeypatch, tmp_path):
    # EPILORA_VLLM_PRECOMPILE=1 with the kernels' in-memory caches emptied (the engines above
    # compiled these shapes): while the engine starts, the precompile thread compiles our two
    # kernels, as warmups, and vLLM's graph capture (its eager warm-up run before each size
    # included) compiles none of them (had the thread compiled other variants than the capture
    # launches, the capture would compile them); one job per projection shape, all done and
    # recorded; the answers are the graphed engine's. vLLM's profiling run (dummy adapters at
    # its largest batch, a size the jobs leave out) may compile in the main thread. Then a
    # second engine, the in-memory caches emptied again (a new process's), on the first's
    # records: each job runs only the sizes its record names, the capture still compiles
    # nothing of ours (what the other sizes need was loaded with those), nor does serving
    # compile anything the first engine did not, and the answers are the same.
    import threading

    import triton
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from epilora_kernels import _fused_kernels
    from epilora_vllm import precompile

    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    want = generate(graphed[0], requests)
    kernels = (_fused_kernels._quantize_shrink_kernel, _fused_kernels._lora_gemm_kernel)
    names = {kernel.fn.__qualname__ for kernel in kernels}
    compiles, phase = [], ["start"]

    def hook(*, fn, is_manual_warmup, **_):
        if fn.name in names:
            compiles.append((fn.name, threading.current_thread().name, is_manual_warmup,
                             phase[0]))

    capture_model = GPUModelRunner.capture_model

    def capturing(self):
        phase[0] = "capture"
        try:
            return capture_model(self)
        finally:
            phase[0] = "started"

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    monkeypatch.setattr(GPUModelRunner, "capture_model", capturing)
    monkeypatch.setenv("EPILORA_VLLM_PRECOMPILE", "1")
    # Records of the plugin's own, apart from the earlier engines' (which would cut every job
    # to the sizes that met kernels new to it then); each whole job is recorded there.
    monkeypatch.setattr(precompile._env, "cache_dir", lambda: str(tmp_path))
    for kernel in kernels:
        kernel.device_caches.clear()
    precompile._jobs.clear()
    llm = engine(checkpoints["fp8"])
    assert phase == ["started"], "the engine captured no graphs"
    started = list(compiles)  # before generate's eager batches of other sizes
    assert len(precompile._jobs) == 4
    assert all(job.done.done() and job.compiled for job in precompile._jobs.values())
    assert len(list(tmp_path.glob("precompiled/*.json"))) == 4
    ahead = {name for name, thread, warmup, _ in started
             if thread == "epilora-precompile" and warmup}
    assert ahead == names, started
    assert not [c for c in started if c[3] == "capture"], started
    assert generate(llm, requests) == want
    served_first = compiles[len(started):]
    del llm

    compiles.clear()
    phase[0] = "start"
    for kernel in kernels:
        kernel.device_caches.clear()
    precompile._jobs.clear()
    again = engine(checkpoints["fp8"])
    assert phase == ["started"], "the second engine captured no graphs"
    jobs = list(precompile._jobs.values())
    assert len(jobs) == 4 and all(job.done.done() and job.compiled for job in jobs)
    assert all(job.recorded and len(job.run) < len(job.sizes) for job in jobs), [
        (job.key, len(job.run), len(job.sizes), job.recorded) for job in jobs]
    started_again = list(compiles)
    assert not [c for c in started_again if c[3] == "capture"], started_again
    assert generate(again, requests) == want
    assert len(compiles) - len(started_again) <= len(served_first), (compiles, served_first)


@pytest.fixture(scope="module")
def sleepy(checkpoints, graphed):
    """The FP8 engine with the plugin under vLLM's sleep mode (CUDA graphs on), its kernels'
    workspace allocated afresh while it loads (an earlier engine's would otherwise serve)."""
    from epilora_vllm import forward

    del graphed  # after the graphed engine
    forward._workspaces.clear()  # the plugin's record of the sized workspace, process-wide
    llm = engine(checkpoints["fp8"], enable_sleep_mode=True)
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    return llm, requests, generate(llm, requests)


def test_the_kernels_counters_lie_outside_the_sleep_mode_pool(sleepy):
    """Level 2 discards the pool's contents; counters there would wake with garbage."""
    from vllm.device_allocator.cumem import CuMemAllocator

    import epilora_kernels as ek

    pool = CuMemAllocator.get_instance().pointer_to_data
    assert pool, "the engine allocated nothing in the sleep-mode pool: not under sleep mode"
    counters = ek.default_workspace(torch.device("cuda")).counters(0).data_ptr()
    inside = [(ptr, data.handle[1]) for ptr, data in pool.items()
              if ptr <= counters < ptr + data.handle[1]]
    assert not inside, f"counters at {counters:#x} in pool allocations {inside}"


def test_sleep_level_1_then_wake_up_gives_every_tenant_the_same_answers(sleepy):
    llm, requests, before = sleepy
    llm.sleep(level=1)  # weights and adapters offloaded to the CPU, the KV cache discarded
    llm.wake_up()
    assert generate(llm, requests) == before


@pytest.mark.xfail(raises=ValueError, strict=True, reason=(
    "vLLM 0.26 cannot reload weights into a model with LoRA: reload_weights looks for "
    "'embed_tokens.weight' where vLLM's own VocabParallelEmbeddingWithLoRA holds "
    "'embed_tokens.base_layer.weight' (stock vLLM alike); this fails loudly when it is fixed"))
def test_sleep_level_2_then_wake_up_reload_and_readded_adapters_give_the_same_answers(sleepy):
    """Level 2 discards the weights and vLLM's adapter buffers (the plugin's counters stay
    resident): after waking, the weights are reloaded and the adapters removed so that the next
    request loads them again, as stock vLLM needs too."""
    llm, requests, before = sleepy
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    for lora_id in sorted(llm.llm_engine.list_loras()):
        llm.llm_engine.remove_lora(lora_id)
    assert generate(llm, requests) == before


def test_the_matched_mode_computes_w8a16_without_lora_eagerly_and_in_cuda_graphs(
        checkpoints, monkeypatch):
    # The kernels computing every FP8 linear of an engine without LoRA (eager: the calls
    # against float64); in vLLM's default configuration (torch.compile, CUDA graphs, its
    # compile cache on) the compiled graph calls them: the warm-up and capture run them, at
    # every projection's shape.
    import epilora_kernels as ek

    eager = assert_the_matched_mode_computes_w8a16_without_lora(checkpoints, monkeypatch,
                                                                enforce_eager=True)
    del eager
    shapes = set()
    w8a16_gemm = ek.w8a16_gemm
    monkeypatch.setattr(ek, "w8a16_gemm", lambda x, weight, *args, **kwargs: (
        shapes.add(tuple(weight.shape)), w8a16_gemm(x, weight, *args, **kwargs))[1])
    llm = engine(checkpoints["fp8"], lora=False)
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name != "NONE"
    want = {tuple(p.weight.t().shape) for p in layer0_projections(llm).values()}
    assert want <= shapes, (want, shapes)
    tokens = generate(llm, [(p, None) for p in PROMPTS])
    assert all(len(t) == MAX_TOKENS for t in tokens), tokens


def test_with_a_prefetch_budget_the_engine_in_cuda_graphs_gives_the_same_answers(
        checkpoints, graphed, monkeypatch):
    # EPILORA_VLLM_PREFETCH_MIB: each served layer's decode GEMM pulls the next served layer's
    # weight into L2 (a hint): in vLLM's default configuration the answers are those of the
    # engine without it, and the layers learned the decoder's order before the capture.
    llm, _ = graphed
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    want = generate(llm, requests)
    monkeypatch.setenv("EPILORA_VLLM_PREFETCH_MIB", "24")
    prefetching = engine(checkpoints["fp8"])
    order = [m.epilora for layer in model_of(prefetching).model.layers
             for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert [f.next_layer() for f in order] == [*order[1:], None]
    assert generate(prefetching, requests) == want
    # The decode calls (those the graphs captured among them) went through a projection that
    # prefetches the next layer's weight; the last layer's prefetches nothing.
    for forward, following in zip(order, order[1:], strict=False):
        assert forward._projection[1].prefetch.tensor is following._weights()[0]
    assert order[-1]._projection[1].prefetch is None
