"""Routing capture (hooks/capture.py) without vLLM: references kept when the router's Python runs, static buffers
when Dynamo traces it, per-graph tables under CUDA-graph capture; real CUDA graphs only where there is a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from moetrace.hooks.capture import (
    NothingCaptured,
    RoutingCapture,
    own_rows_start,
    unwrap_router,
    wrap_router,
)
from moetrace.hooks.rows import PackedLayout
from moetrace.hooks.vllm_api import StepInputs
from moetrace.writer.ring import SharedRows

E, K, L, C = 32, 4, 3, 6  # experts, top-k, layers, candidates
SIZES = (1, 2, 4, 8)


class BiasRouter:
    """The shape of vLLM's sigmoid + selection-bias router: ``_compute_routing`` returns (weights, ids)."""

    scoring_func = "sigmoid"

    def __init__(self, seed: int, device: str = "cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.e_score_correction_bias = (torch.randn(E, generator=gen) * 0.05).to(device)
        self.calls = 0

    def _compute_routing(
        self, hidden_states: Any, router_logits: torch.Tensor, indices_type: Any = None, *, input_ids: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        scores = router_logits.float().sigmoid()
        ids = (scores + self.e_score_correction_bias).topk(K, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)


def reference(routers: list[BiasRouter], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing computed independently of the wrapper: ids sorted per row, weights in id order. [T, L, K] each"""
    ids, weights = [], []
    for router, layer_logits in zip(routers, logits.unbind(1)):
        scores = layer_logits.float().sigmoid()
        top = (scores + router.e_score_correction_bias).topk(K, dim=-1).indices
        w = scores.gather(1, top)
        ids.append(top)
        weights.append(w / w.sum(-1, keepdim=True))
    return by_id(torch.stack(ids, dim=1), torch.stack(weights, dim=1))


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.long().sort(dim=-1)
    return ids_sorted.cpu(), weights.gather(-1, order).float().cpu()


def forward(routers: list[Any], logits: torch.Tensor) -> None:
    """What the model does per layer: call each router on its logits [P, E] (logits: [P, L, E])."""
    for router, layer_logits in zip(routers, logits.unbind(1)):
        router._compute_routing(None, layer_logits, None, input_ids=None)


def padded(num_tokens: int) -> int:
    return next(s for s in SIZES if s >= num_tokens)


def setup(candidates: int = 0, device: str = "cpu") -> tuple[list[BiasRouter], RoutingCapture, list[Any]]:
    routers = [BiasRouter(seed, device) for seed in range(L)]
    key: list[Any] = [None]
    capture = RoutingCapture(max(SIZES), L, K, candidates, torch.device(device), graph_key=lambda: key[0])
    for slot, router in enumerate(routers):
        wrap_router(router, slot, capture)
    return routers, capture, key


def collected(capture: RoutingCapture, num_tokens: int, replayed: Any = None, mechanism: str | None = None
              ) -> dict[str, torch.Tensor]:
    """Rows of the forward just run, on the host, packed side by side as the recorder packs them."""
    used, columns = capture.collect(num_tokens, replayed)
    assert mechanism is None or used == mechanism
    assert all(column.shape[0] >= num_tokens for column in columns)
    return unpacked(capture, torch.cat(columns, dim=1)[:num_tokens])  # padding rows, if any, come last


def unpacked(capture: RoutingCapture, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """The collected int32 block, split into its fields [T, L, K or C]."""
    assert block.dtype == torch.int32
    layout = PackedLayout(capture.num_layers, capture.top_k, capture.candidates, token_ids=False)
    assert block.shape[1] == layout.routing_width
    return {name: torch.from_numpy(a) for name, a in layout.unpack_routing(block.cpu().numpy()).items()}


def assert_rows_equal(rows: dict[str, torch.Tensor], routers: list[BiasRouter], logits: torch.Tensor) -> None:
    num_tokens = rows["ids"].shape[0]
    got = by_id(rows["ids"], rows["weights"])
    want = reference(routers, logits[:num_tokens])
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-6)


def test_eager_forwards_keep_references_that_equal_the_computed_routing_without_padding_rows() -> None:
    routers, capture, _ = setup()
    gen = torch.Generator().manual_seed(1)
    for num_tokens in (1, 3, 5, 8, 2):
        logits = torch.randn(padded(num_tokens), L, E, generator=gen).bfloat16()  # rows [T:P] are padding
        capture.begin_step()
        forward(routers, logits)
        assert all(k is not None for k in capture.step) and not capture.graphs
        rows = collected(capture, num_tokens, mechanism="eager")
        assert rows["ids"].shape == (num_tokens, L, K) and rows["ids"].dtype == torch.int32
        assert rows["weights"].dtype == torch.float32
        assert_rows_equal(rows, routers, logits)


def test_a_router_that_sees_every_dp_ranks_tokens_records_only_this_ranks_rows() -> None:
    routers, capture, _ = setup()
    gen = torch.Generator().manual_seed(7)
    across = [2, 3, 1]  # tokens of DP ranks 0, 1, 2 in this forward, gathered rank by rank before routing
    logits = torch.randn(sum(across), L, E, generator=gen).bfloat16()
    for rank, own in enumerate(across):
        capture.begin_step()
        forward(routers, logits)
        used, columns = capture.collect(own, None, across, rank)
        start = sum(across[:rank])
        own_first = torch.cat(columns, dim=1)[:own]  # this rank's rows first, the higher ranks' may follow
        assert_rows_equal(unpacked(capture, own_first), routers, logits[start : start + own])
    # a dispatch that routes before gathering: the first rows are this rank's, padding after them
    assert own_rows_start(4, 3, across, 1) == 0 and own_rows_start(6, 1, None, 0) == 0
    with pytest.raises(ValueError, match="routers saw 2 rows for 3 tokens"):
        own_rows_start(2, 3, across, 1)


def test_candidates_are_the_top_selection_scores() -> None:
    routers, capture, _ = setup(candidates=C)
    logits = torch.randn(4, L, E, generator=torch.Generator().manual_seed(2)).bfloat16()
    capture.begin_step()
    forward(routers, logits)
    rows = collected(capture, 3)
    assert rows["cand_ids"].shape == rows["cand_scores"].shape == (3, L, C)
    for slot, router in enumerate(routers):
        # Written out here, not with the capture's own selection_scores: sigmoid of the logits plus the bias,
        # in float64, sorted by numpy.
        selection = (1 / (1 + np.exp(-logits[:3, slot].double().numpy()))
                     + router.e_score_correction_bias.double().numpy())
        ids = np.argsort(-selection, axis=1, kind="stable")[:, :C]
        assert (rows["cand_ids"][:, slot].numpy() == ids).all()
        assert np.allclose(rows["cand_scores"][:, slot].numpy(), np.take_along_axis(selection, ids, axis=1), atol=1e-6)
        chosen = zip(rows["cand_ids"][:, slot], rows["ids"][:, slot])
        assert all(set(c[:K].tolist()) == set(e.tolist()) for c, e in chosen)


def test_collected_rows_are_owned_and_the_next_forward_does_not_change_them() -> None:
    routers, capture, _ = setup()
    gen = torch.Generator().manual_seed(3)
    first = torch.randn(4, L, E, generator=gen).bfloat16()
    capture.begin_step()
    forward(routers, first)
    rows = collected(capture, 4)
    capture.begin_step()
    forward(routers, torch.randn(4, L, E, generator=gen).bfloat16())
    assert_rows_equal(rows, routers, first)


def test_a_forward_traced_by_dynamo_writes_the_static_buffers() -> None:
    """vLLM on the CPU: Dynamo traces through the router, Python side effects are lost, tensor writes kept."""
    routers, capture, _ = setup(candidates=C)
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    for num_tokens in (8, 5):
        logits = torch.randn(num_tokens, L, E, generator=gen).bfloat16()
        capture.begin_step()
        compiled(routers, logits)
        assert all(k is None for k in capture.step), "the traced path keeps no references"
        rows = collected(capture, num_tokens, mechanism="traced")
        assert_rows_equal(rows, routers, logits)
        assert rows["cand_ids"].shape == (num_tokens, L, C)


class FixedOutputRouter(BiasRouter):
    """Writes into one output tensor per padded size, as a replayed CUDA graph writes to the addresses it
    captured: a CPU stand-in for replay."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute_routing(self, hidden_states: Any, router_logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        weights, ids = super()._compute_routing(hidden_states, router_logits)
        out_w, out_ids = self.out.setdefault(ids.shape[0], (torch.empty_like(weights), torch.empty_like(ids)))
        out_w.copy_(weights)
        out_ids.copy_(ids)
        return out_w, out_ids


def test_references_taken_during_graph_capture_are_kept_per_graph_and_read_after_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    routers = [FixedOutputRouter(seed) for seed in range(L)]
    key: list[Any] = [None]
    capture = RoutingCapture(max(SIZES), L, K, 0, torch.device("cpu"), graph_key=lambda: key[0])
    for slot, router in enumerate(routers):
        wrap_router(router, slot, capture)
    capture.cuda = True  # the table path, on the CPU: "capturing" is what the stream says
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    gen = torch.Generator().manual_seed(5)
    for size in SIZES:  # "capture" each size
        key[0], capturing[0] = ("FULL", size), True
        forward(routers, torch.randn(size, L, E, generator=gen).bfloat16())
        capturing[0] = False
    assert set(capture.graphs) == {("FULL", s) for s in SIZES} and all(k is None for k in capture.step)
    for num_tokens in (3, 1, 8, 6, 2):
        size = padded(num_tokens)
        logits = torch.randn(size, L, E, generator=gen).bfloat16()
        capture.begin_step()
        for router, layer_logits in zip(routers, logits.unbind(1)):  # "replay": no wrapper, same addresses
            type(router)._compute_routing(router, None, layer_logits)
        rows = collected(capture, num_tokens, replayed=("FULL", size), mechanism="graph")
        assert rows["ids"].shape[0] == num_tokens
        assert_rows_equal(rows, routers, logits)
    with pytest.raises(NothingCaptured, match="captured without the wrapper"):
        capture.collect(1, replayed=("PIECEWISE", 1))


def test_a_partly_recorded_forward_is_refused() -> None:
    routers, capture, _ = setup()
    capture.begin_step()
    forward(routers[:2], torch.randn(2, 2, E).bfloat16())
    with pytest.raises(NothingCaptured, match="partly recorded"):
        capture.collect(2)


def test_a_forward_that_no_router_ran_is_refused_not_recorded_as_zeros() -> None:
    """A vLLM that stops calling the wrapped method (or a kernel that fuses routing) leaves no references, no
    replayed graph and no trace: the static buffers still hold zeros, and they must not become rows."""
    _, capture, _ = setup()
    capture.begin_step()  # the model ran, but not through any wrapped router
    with pytest.raises(NothingCaptured, match="no router ran in this forward"):
        capture.collect(4)


def test_an_error_inside_the_wrapper_returns_the_routers_result_and_is_kept_for_the_recorder() -> None:
    routers, capture, _ = setup(candidates=C)
    logits = torch.randn(3, L, E, generator=torch.Generator().manual_seed(7)).bfloat16()
    capture.begin_step()
    routers[0]._compute_routing(None, logits[:, 0], None, input_ids=None)
    assert capture.failed is None

    def renamed(*args: Any) -> None:  # what a vLLM that renamed something the capture reads looks like
        raise AttributeError("'ForwardContext' object has no attribute 'batch_descriptor'")

    capture.keep = renamed  # type: ignore[method-assign]
    got = routers[1]._compute_routing(None, logits[:, 1], None, input_ids=None)  # must not raise
    want = BiasRouter._compute_routing(BiasRouter(1), None, logits[:, 1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "the router's own result, untouched"
    assert capture.failed is not None and "layer slot 1" in capture.failed and "batch_descriptor" in capture.failed


def test_wrap_is_idempotent_and_unwrap_restores_the_router() -> None:
    routers, capture, _ = setup()
    router = routers[0]
    wrapped = router._compute_routing
    wrap_router(router, 0, capture)
    assert router._compute_routing is wrapped, "wrapping twice wraps once"
    capture.begin_step()
    forward(routers, torch.randn(2, L, E).bfloat16())
    assert router.calls == 1
    unwrap_router(router)
    assert "_compute_routing" not in vars(router), "the class method shows through again"
    unwrap_router(router)  # never wrapped now: left alone
    assert "_compute_routing" not in vars(router)

    custom = BiasRouter(9)
    def own(*args: Any, **kwargs: Any) -> Any:  # an instance-level routing function stays as it was
        return BiasRouter._compute_routing(custom, *args, **kwargs)

    custom._compute_routing = own  # type: ignore[method-assign]
    wrap_router(custom, 0, capture)
    unwrap_router(custom)
    assert vars(custom)["_compute_routing"] is own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_replays_record_what_eager_routing_computes() -> None:
    routers, capture, key = setup(candidates=C, device="cuda")
    static = {s: torch.zeros(s, L, E, dtype=torch.bfloat16, device="cuda") for s in SIZES}
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    for size in sorted(SIZES, reverse=True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(routers, static[size])
        torch.cuda.current_stream().wait_stream(side)
        key[0], graphs[size] = size, torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[size], pool=pool):
            forward(routers, static[size])
    gen = torch.Generator(device="cuda").manual_seed(6)
    for num_tokens in (3, 1, 8, 6, 2, 7, 4, 5):
        size = padded(num_tokens)
        logits = torch.randn(size, L, E, generator=gen, device="cuda").bfloat16()
        static[size].copy_(logits)
        capture.begin_step()
        graphs[size].replay()
        rows = collected(capture, num_tokens, replayed=size)
        assert_rows_equal(rows, routers, logits)


def step_inputs(positions: torch.Tensor, input_ids: torch.Tensor, num_tokens: int) -> StepInputs:
    return StepInputs(req_ids=["r"], query_start=np.array([0, num_tokens]), num_prompt_tokens=np.array([2]),
                      drafts=np.array([num_tokens - 1]), positions=positions, input_ids=input_ids)


def test_a_padded_graph_step_packs_its_rows_first_from_a_list_made_once_that_reads_each_steps_values() -> None:
    """A CUDA graph padded to 4 rows, 3 of them this step's: the columns are the graph's own and the runner's
    persistent buffers, listed once, so the next step's values (written in place) are what the next pack reads."""
    from moetrace.hooks.transfer import PackingColumns, StepCopier

    graph_ids = torch.tensor([[1, 2], [3, 4], [5, 6], [-7, -7]], dtype=torch.int32)  # row 4: padding
    positions = torch.arange(16, dtype=torch.int64)  # the runner's buffers, longer than any step
    input_ids = torch.arange(100, 116, dtype=torch.int32)
    ring = SharedRows.create(16, 4)
    packing, copier = PackingColumns(token_ids=True), StepCopier(torch.device("cpu"), ring, 16)

    def packed(columns: list[torch.Tensor]) -> list[list[int]]:
        where = ring.reserve(columns[0].shape[0])
        assert where is not None
        copier.copy(columns, where)
        return ring.take(where._replace(rows=3)).tolist()

    routing = [graph_ids]  # as the capture hands a graph's columns out: the same list at every replay
    first = packing.columns(("FULL", 4), routing, step_inputs(positions, input_ids, 3), 3)
    assert packed(first) == [[1, 2, 0, 100], [3, 4, 1, 101], [5, 6, 2, 102]]
    graph_ids[:3] += 10  # the next replay rewrites the graph's outputs, vLLM the buffers, in place
    positions[:3] += 1
    again = packing.columns(("FULL", 4), routing, step_inputs(positions, input_ids, 3), 3)
    assert again is first
    assert packed(again) == [[11, 12, 1, 100], [13, 14, 2, 101], [15, 16, 3, 102]]
    # the capture handing out a new list for the graph (captured again): a new list packed from it
    assert packing.columns(("FULL", 4), [graph_ids], step_inputs(positions, input_ids, 3), 3) is not first
    # a runner whose arrays hold this step's rows only (Model Runner V2's batch): the routing is cut to them, and a
    # list cut to one step's tokens is never reused for the next step's
    short_buffers = (positions[:3], input_ids[:3])  # the same tensors at both steps
    short = packing.columns(("FULL", 8), routing, step_inputs(*short_buffers, 3), 3)
    assert [c.shape[0] for c in short] == [3, 3, 3]
    assert [c.shape[0] for c in packing.columns(("FULL", 8), routing, step_inputs(*short_buffers, 2), 2)] == [2] * 3
    # an eager forward (no graph): a list of its own each step, never kept
    eager_routing = [graph_ids[:3]]
    eager = packing.columns(None, eager_routing, step_inputs(positions, input_ids, 3), 3)
    assert eager is not packing.columns(None, eager_routing, step_inputs(positions, input_ids, 3), 3)
    # routers that saw fewer rows than the step has tokens: refused, never packed short
    with pytest.raises(RuntimeError, match="the routers saw 2 rows for the step's 3 tokens"):
        packing.columns(None, [graph_ids[:2]], step_inputs(positions, input_ids, 3), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["mapped", "device-copy"])
def test_a_step_copied_after_the_forward_holds_what_it_wrote_after_the_next_step_overwrites_the_inputs(
        path: str) -> None:
    """The copy is queued after the forward (a slow kernel, then the step's values, on vLLM's stream) and before the
    next step's inputs overwrite the buffers: a sync of vLLM's stream then finds the copy landed in the shared ring
    and untouched, whether the GPU packs into the ring itself (mapped) or packs on the device and copies."""
    from moetrace.hooks.transfer import StepCopier

    ring = SharedRows.create(100, 8)  # steps wrap around it
    copier = StepCopier(torch.device("cuda"), ring, 64)
    assert copier.path == "mapped"  # the ring is registered pinned memory, which an H200's kernels write directly
    if path == "device-copy":
        copier._mapped, copier._block = None, torch.empty((64, 8), dtype=torch.int32, device="cuda")
        assert copier.path == "device-copy"
    slow = torch.randn(4096, 4096, device="cuda")
    inputs = torch.zeros(64, 8, dtype=torch.int32, device="cuda")  # the runner's persistent input buffer
    gen = torch.Generator().manual_seed(7)
    for rows in (64, 1, 33, 7, 64):
        expected = torch.randint(0, 2**31 - 1, (rows, 8), generator=gen, dtype=torch.int32)
        staged = expected.pin_memory()
        for _ in range(4):
            slow = slow @ slow / 64  # the forward: long enough that an unordered copy would read stale values
        inputs[:rows].copy_(staged, non_blocking=True)
        where = ring.reserve(rows)
        assert where is not None
        copier.copy([inputs[:rows, :5], inputs[:rows, 5:]], where)
        inputs.fill_(-1)  # the next step's inputs
        torch.cuda.current_stream().synchronize()  # what vLLM's sync waits for
        assert torch.equal(torch.from_numpy(ring.take(where)), expected)
    copier.release()
    ring.close()


def test_the_engine_side_never_imports_the_analysis_stack() -> None:
    """Hooks and the writer run inside vLLM's workers: polars, plotly, rich and click stay out of them."""
    import subprocess
    import sys

    engine_side = ["moetrace.hooks.plugin", "moetrace.hooks.recorder", "moetrace.hooks.capture",
                   "moetrace.hooks.rows", "moetrace.hooks.manifest", "moetrace.hooks.vllm_api",
                   "moetrace.writer.process", "moetrace.writer.ring", "moetrace.trace.files"]
    probe = (f"import importlib, sys\nfor name in {engine_side!r}: importlib.import_module(name)\n"
             "print(sorted(m for m in ('polars', 'plotly', 'rich', 'click') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_reader_never_imports_the_recording_side() -> None:
    """Recording and analysis meet only through the trace files: the reader needs the contract (moetrace.trace.schema),
    not the writer or the hooks."""
    import subprocess
    import sys

    probe = ("import sys, moetrace.trace.reader\n"
             "print(sorted(m for m in sys.modules if m in ('moetrace.writer.process', 'moetrace.writer.ring',"
             " 'moetrace.trace.files') or m.startswith('moetrace.hooks')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
