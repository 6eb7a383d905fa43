"""CUDA graphs of a function of fixed-shape tensors, for launch-bound work replayed as one launch.

A once-per-request module such as Krea-2's text encoder runs a few hundred small kernels at one padded shape; eagerly
its time is the CPU launching them (about 50 ms at full size on an H200), on the GPU only about 10 ms.
`StaticGraphs(fn, weights)` captures `fn` once per input signature (shapes, dtypes, device) and then replays it:

- `fn` takes tensors and returns one tensor; it must not synchronise with the host (no `.item()`, no data-dependent
  Python branches), which the capture enforces by failing;
- inputs are copied into the graph's own buffers and the output is cloned out of them, so callers get fresh tensors;
- calls from several threads or CUDA streams take turns: a lock orders the host side and an event recorded after
  each clone makes the next caller's stream wait, without a host synchronisation;
- the graph reads the weights at the addresses they had when captured: if `weights()` yields other tensor objects
  (the module was quantised or replaced), every graph is dropped and captured again;
- CPU tensors, and signatures beyond `max_graphs`, run `fn` eagerly; replaying gives the eager call's values;
- a signature whose capture fails (`fn` synchronised after all) runs eagerly from then on, with one warning: slower,
  never different.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("dicache.static_graphs")


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor
    done: torch.cuda.Event


class StaticGraphs:
    """`fn` replayed from CUDA graphs, one per input signature (module docstring).

    fn: tensors -> tensor. weights: yields the tensors `fn` reads besides its inputs (a module's `parameters`).
    max_graphs: signatures captured at most (each keeps its activations' memory pool); others run eagerly.
    warmup_calls: eager calls on a side stream before a capture (lazy initialisation, kernel plans).
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        weights: Callable[[], Iterable[torch.Tensor]],
        max_graphs: int = 4,
        warmup_calls: int = 2,
    ):
        if max_graphs < 1 or warmup_calls < 1:
            raise ValueError(f"max_graphs={max_graphs}, warmup_calls={warmup_calls}: both must be at least 1")
        self.fn = fn
        self.weights = weights
        self.max_graphs = int(max_graphs)
        self.warmup_calls = int(warmup_calls)
        self._graphs: dict[tuple, _Graph | None] = {}  # None: the capture failed, run eagerly
        self._weights_key: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self.captures = 0
        """Graphs captured so far (a recapture after the weights changed counts again)."""

    @property
    def num_graphs(self) -> int:
        """Graphs held (signatures whose capture failed not counted)."""
        return sum(entry is not None for entry in self._graphs.values())

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
            return self.fn(*inputs)
        if torch.cuda.is_current_stream_capturing():  # inside someone else's capture: be part of it
            return self.fn(*inputs)
        signature = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
        with self._lock:
            entry = self._entry(signature, inputs)
            if entry is not None:
                stream = torch.cuda.current_stream(inputs[0].device)
                stream.wait_event(entry.done)  # the previous replay's clone has read the output buffer
                for buffer, x in zip(entry.inputs, inputs):
                    buffer.copy_(x, non_blocking=True)
                entry.graph.replay()
                output = entry.output.clone()
                entry.done.record(stream)
                return output
        return self.fn(*inputs)  # outside the lock: eager calls of several threads run side by side

    def _entry(self, signature: tuple, inputs: tuple[torch.Tensor, ...]) -> _Graph | None:
        """The graph of `signature`, captured now if it is new and there is room; None: run eagerly. Under the lock."""
        weights_key = tuple(id(w) for w in self.weights())
        if weights_key != self._weights_key:
            self._graphs.clear()
            self._weights_key = weights_key
        if signature not in self._graphs:
            if len(self._graphs) >= self.max_graphs:
                return None
            try:
                self._graphs[signature] = self._capture(inputs)
            except RuntimeError as err:  # e.g. an operation that synchronises cannot be captured
                log.warning("CUDA graph capture failed for inputs %s; running eagerly: %s", signature, err)
                self._graphs[signature] = None
        return self._graphs[signature]

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Graph:
        device = inputs[0].device
        buffers = [x.clone() for x in inputs]
        caller = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.fn(*buffers)
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a server's other phases) may keep launching work while this one captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = self.fn(*buffers)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"StaticGraphs: fn must return one tensor, got {type(output).__name__}")
        done = torch.cuda.Event()
        done.record(caller)
        self.captures += 1
        return _Graph(graph, buffers, output, done)
