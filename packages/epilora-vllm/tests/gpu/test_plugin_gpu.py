"""The plugin on the GPU: the checks of the CPU tests (every call of layer 0's projections
against float64 from the files) with the kernels computing, eagerly; then the same engine in
vLLM's default configuration (torch.compile, CUDA graphs), whose graphs hold the kernels."""

import pytest
import torch
from engine_cases import (
    FUSED,
    PROMPTS,
    assert_every_call_matches_the_files,
    engine,
    generate,
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
    mixed = generate(llm, requests)
    assert [generate(llm, [r])[0] for r in requests] == mixed
    by_adapter = [generate(llm, [(PROMPTS[0], request(checkpoints, i))])[0]
                  for i in (None, 1, 2)]
    assert len({tuple(t) for t in by_adapter}) == 3, by_adapter
    torch.cuda.synchronize()
