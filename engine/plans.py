"""Plans: captured CUDA graphs keyed by the shape of the work (batch width, depth, ...), kept in an LRU pool.

In SpecDeck "plan" means this and nothing else: one phase of a round (the draft or the verify) captured as a
CUDA graph for one shape. Its key is the shape plus `Model.plan_tag` (GEMM mode, mirrored head, combine) plus
`SamplingParams.plan_key`; `plan_pool` is how many the pool keeps.

`plan_pool` = how many are kept; 0 = no graphs (eager launches). A round whose shape is not cached runs
eagerly (which also warms every kernel and cuBLAS up) and then captures the same work for next time;
the pool counts hits, misses and capture time. On the CPU, or when CUDA kernels are not in use (the
references read the cache length on the host, which a graph cannot), plans always run eagerly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch


class PlanPool:
    def __init__(self, device: torch.device, capturable: bool) -> None:
        self.device = device
        self.capturable = capturable and device.type == "cuda"
        # key -> (graph, its outputs, bytes its private memory pool took at capture)
        self.graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, Any, int]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.capture_s = 0.0

    @property
    def pool_bytes(self) -> int:
        """Memory of the plans held now (an evicted plan's pool goes with it)."""
        return sum(entry[2] for entry in self.graphs.values())

    def run(self, key: Hashable, capacity: int, work: Callable[[], Any]) -> Any:
        """Run `work` (device work on static buffers only) as a captured graph when possible."""
        if not self.capturable or capacity <= 0:
            self.clear()
            return work()
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            self.hits += 1
            entry[0].replay()
            return entry[1]
        self.misses += 1
        result = work()  # this round's real work, eagerly; it also warms everything up for capture
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private memory pool per plan: evicting one frees its memory
            outputs = work()  # recorded, not executed
        pool = max(0, torch.cuda.memory_reserved(self.device) - before)  # the plan's private pool
        self.capture_s += time.perf_counter() - t0
        self.graphs[key] = (graph, outputs, pool)
        self._evict(capacity)
        return result

    def _evict(self, capacity: int) -> None:
        while len(self.graphs) > capacity:
            self.graphs.popitem(last=False)

    def clear(self) -> None:
        self.graphs.clear()

    def counters(self) -> tuple[int, int, float]:
        return self.hits, self.misses, self.capture_s
