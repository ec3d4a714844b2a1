"""CUDA graphs of pure tensor functions whose argument shapes repeat from case to case.

A case's comparison is many small device ops, each costing more host time to launch than
device time to run (docs/performance.md). :class:`GraphCache` records such a function as a
CUDA graph the second time it sees the same signature (the arguments' shapes, strides,
dtypes and device, and the function's static parameters), then replays it: the same kernels
with the same launch parameters, so the same bits, for one launch and a few copies.
Elsewhere (the CPU, a signature seen once, a function that cannot be captured) the function
runs as it is.

A replay's outputs live in the graph's own memory and are overwritten by its next replay:
callers read them (to the host, or into tensors of their own) before calling again, or ask
for copies (``copy_outputs``) when the results outlive the call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

Fn = Callable[..., tuple[torch.Tensor, ...]]


class _Graph:
    """One captured call: its static inputs, the graph, and the outputs it writes."""

    def __init__(self, fn: Fn, args: tuple[torch.Tensor, ...], params: Hashable) -> None:
        self.inputs = tuple(a.clone() for a in args)
        side = torch.cuda.Stream(device=args[0].device)
        side.wait_stream(torch.cuda.current_stream(args[0].device))
        with torch.cuda.stream(side):  # warm up lazily initialised state outside the capture
            fn(*self.inputs, params)
        torch.cuda.current_stream(args[0].device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs, params)

    def replay(self, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, arg in zip(self.inputs, args, strict=True):
            static.copy_(arg)
        self.graph.replay()
        return self.outputs


class GraphCache:
    """Calls ``fn(*args, params)`` through a CUDA graph once its signature repeats.

    ``fn`` must be a pure function of its tensor arguments and the hashable ``params``,
    return a tuple of tensors, and never synchronise with the host. At most ``capacity``
    graphs are kept (least recently used first out), and as many signatures remembered.
    ``copy_outputs``: a replay returns copies of the graph's outputs, which the next replay
    leaves alone.
    """

    def __init__(self, capacity: int = 8, copy_outputs: bool = False) -> None:
        self.capacity = capacity
        self.copy_outputs = copy_outputs
        self._seen: OrderedDict[Hashable, bool] = OrderedDict()  # signature -> capturable
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()

    def __call__(self, fn: Fn, args: tuple[torch.Tensor, ...], params: Hashable
                 ) -> tuple[torch.Tensor, ...]:
        """``fn(*args, params)``, replayed from a graph where one is recorded."""
        device = args[0].device
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return fn(*args, params)
        key = (fn, params, tuple((a.shape, a.stride(), a.dtype, a.device) for a in args))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return self._outputs(graph.replay(args))
        capturable = self._seen.get(key)
        if not capturable:  # first sight, or a capture that failed: run it as it is
            self._remember(key, capturable is None)
            return fn(*args, params)
        try:
            graph = _Graph(fn, args, params)
        except Exception:  # not capturable here: never try this signature again
            self._remember(key, False)
            return fn(*args, params)
        self._graphs[key] = graph
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return self._outputs(graph.replay(args))

    def _outputs(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(o.clone() for o in outputs) if self.copy_outputs else outputs

    def _remember(self, key: Hashable, capturable: bool) -> None:
        self._seen[key] = capturable
        self._seen.move_to_end(key)
        if len(self._seen) > 4 * self.capacity:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        """How many graphs are recorded."""
        return len(self._graphs)

    def clear(self) -> None:
        """Forget every graph and signature (frees the graphs' memory)."""
        self._graphs.clear()
        self._seen.clear()

