"""CUDA-graph capture of a step, shared by the GPU tests and benchmarks/host_time.py."""
from __future__ import annotations

import torch


def capture(step, warmup: int = 3):
    """``(graph, outputs)``: ``step()`` run ``warmup`` times on a side stream (as capture requires),
    then captured once; replaying the graph recomputes ``outputs`` in place from the same input tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
