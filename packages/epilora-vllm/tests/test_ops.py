"""The plugin's custom ops under torch.compile: a layer's name reaches the op as a graph input,
not a constant, so that decoder layers alike trace to pieces alike (Inductor compiles one)."""

import types

import pytest
import torch

pytestmark = pytest.mark.vllm


class _Layer:
    def epilora(self, x, codes, scales, bias):
        return torch.full((codes.shape[0], 8), 2.0, dtype=torch.bfloat16)


class _Projection(torch.nn.Module):
    # the op's call as the plugin's layers make it (their own encoder of the name)
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, codes, scales):
        from epilora_vllm.layers import _encode_layer_name

        return torch.ops.epilora_vllm.lora_linear_codes(_encode_layer_name(self.name), 8, codes,
                                                         scales)


def test_layer_names_are_graph_inputs_not_constants(monkeypatch):
    import epilora_vllm.ops as ops

    names = ("model.layers.0.mlp.down_proj.epilora", "model.layers.1.mlp.down_proj.epilora")
    context = types.SimpleNamespace(no_compile_layers={name: _Layer() for name in names})
    monkeypatch.setattr(ops, "get_forward_context", lambda: context)
    model = torch.nn.Sequential()
    model.first, model.second = (_Projection(name) for name in names)

    def both(codes, scales):
        return model.first(codes, scales) + model.second(codes, scales)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    codes = torch.zeros(3, 16, dtype=torch.float8_e4m3fn)
    out = torch.compile(both, backend=backend, fullgraph=True)(codes, torch.ones(3, 1))
    assert torch.equal(out, torch.full((3, 8), 4.0, dtype=torch.bfloat16))
    (graph,) = graphs
    code = graph.code
    assert not any(name in code for name in names), code
    calls = [node for node in graph.graph.nodes
             if node.target in (torch.ops.epilora_vllm.lora_linear_codes,
                                torch.ops.epilora_vllm.lora_linear_codes.default)]
    assert len(calls) == 2
    assert all(call.args[0].op == "placeholder" for call in calls), code
