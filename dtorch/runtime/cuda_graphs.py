"""CUDA graphs of hot replayed programs: a whole program, launched as one graph.

On a GPU the cost of a small kernel is its launch: the host's Python and the driver's call,
microseconds each, while the kernel itself may take less. Once a program is hot on a CUDA
device (``runtime/fusion.py``: replayed ``config.fusion_after`` times with the same scalars) and
its stretches have been fused, the compiler thread captures the whole lowering, fused steps
included, as a ``torch.cuda.CUDAGraph`` over static input buffers. A replay then copies the
outside inputs into those buffers, launches the graph, and clones the results that outlive the
program out of the graph's private memory (the next launch overwrites it): a few launches per
window instead of one or more per kernel.

A program qualifies when it writes no outside input in place (the write would land in the
static copy). The capture is checked as fusion is: the graph, launched on the copies of the
probed run's inputs, must give the same bits as the steps run one by one on them; otherwise,
or if capturing raises (a kernel that syncs with the CPU, say), the program keeps its steps.
The graph is one ``Fused`` step, so an input that failed sends a run through the steps instead.

Not yet run on a GPU: no device was lent to the sessions that wrote it (see the README).
"""

from __future__ import annotations

import torch


def capturable(steps) -> bool:
    """No step writes an outside input (in place). (A replayed program has no collective.)"""
    return all(ref >= 0 for step in steps for ref in step.outs)


def capture(run_steps, copies, device):
    """``(replay, got, expected)``: a function replaying ``run_steps`` (the program as a
    function of its outside reads, in order) as a CUDA graph, what the graph gave on ``copies``
    (the probed run's inputs) and what ``run_steps`` gave on them, for the caller to compare;
    None when it cannot be captured."""
    static = [c.clone() for c in copies]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        expected = run_steps(*copies)  # also the warm-up a capture needs
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = run_steps(*static)
        except RuntimeError:
            return None
        graph.replay()
        stream.synchronize()
        got = [o.clone() for o in outputs]

    def replay(*args):
        for buffer, value in zip(static, args):
            buffer.copy_(value)
        graph.replay()  # on the calling stream thread's current stream
        return tuple(o.clone() for o in outputs)

    return replay, got, expected
