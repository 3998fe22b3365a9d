"""CUDA-graph capture for tests: warm up on a side stream, capture, return graph and output."""

from collections.abc import Callable

import torch


def capture(fn: Callable[[], torch.Tensor], warmup: int = 1):
    """Run `fn` `warmup` times on a side stream (so lazy work such as Triton compilation and
    allocations happens outside the capture), then capture one call. Returns `(graph, output)`;
    `graph.replay()` recomputes `output` in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output
