"""Graph-safe routing capture: every target-model router's top-k, with no host sync and no kernel in the forward.

# T tokens in a forward (T_pad: padded to a CUDA-graph size), L recorded MoE layers, K top-k, C router candidates,
# E experts

The wrapper around ``router._compute_routing`` has one mechanism for each way the router's Python is run:

- **It runs** (eager; and on GPU, where vLLM's MoE is the opaque op ``moe_forward``, also while a CUDA graph is
  captured): the wrapper keeps references to the router's own output tensors, no kernel. During CUDA-graph
  capture they go into the table of the graph being captured (``graph_key()``); they live in the graph's private
  pool, and holding them keeps their addresses from being reused, so after every replay of that graph they hold
  that replay's values. Routers return tensors allocated per call (no shared workspace), which this relies on.
- **Dynamo traces it** (vLLM compiling on CPU): Python side effects are lost, tensor writes are kept, so the
  wrapper copies into static buffers [T_max, L, K] instead (two copies per layer).
- **It never runs** (a MoE kernel that fuses routing takes the router logits): ``wrap_logits_entry`` wraps the
  call that receives the logits and runs the router's own ``_compute_routing`` on them, recorded as above.

After the forward, ``collect`` names rows [:T] of whichever mechanism ran (and says which: a forward that none
of them wrote is refused, never recorded as zeros) as int32 columns: views of the routers' own tensors (made once
per CUDA graph), left on the device for the recorder to pack and copy out without blocking. The wrapper never
raises into the forward: an error inside it is kept in ``RoutingCapture.failed`` and the router's own result is
returned untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from moetrace.hooks.budget import LayerBudget, TokenGroups, restrict
from moetrace.hooks.replay import ReplayedRouting
from moetrace.hooks.vllm_api import require_fields

RoutingFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
GraphKey = Callable[[], Hashable]
_WRAPPED_MARK = "_moetrace_original_compute_routing"
_ENTRY_MARK = "_moetrace_recomputing_entry"
FIELDS = ("ids", "weights", "cand_ids", "cand_scores")
_DTYPES = {"ids": torch.int32, "weights": torch.float32, "cand_ids": torch.int32, "cand_scores": torch.float32}


@dataclass
class RouterInfo:
    """What the trace needs to know about one wrapped router."""

    layer: int
    num_experts: int
    top_k: int
    scoring_func: str
    routed_scaling_factor: float


class Kept(NamedTuple):
    """One layer's routing as the router returned it: ids/weights [T, K], candidates [T, C] or None."""

    ids: torch.Tensor
    weights: torch.Tensor
    cand_ids: torch.Tensor | None
    cand_scores: torch.Tensor | None


class RoutingBuffers:
    """Static buffers for the traced path: ids/weights [T_max, L, K], cand_ids/cand_scores [T_max, L, C]."""

    def __init__(self, max_tokens: int, num_layers: int, top_k: int, candidates: int, device: torch.device):
        widths = {"ids": top_k, "weights": top_k, "cand_ids": candidates, "cand_scores": candidates}
        self.fields = {
            name: torch.zeros(max_tokens, num_layers, widths[name], dtype=_DTYPES[name], device=device)
            for name in FIELDS
            if widths[name]
        }

    def write(self, slot: int, kept: Kept) -> None:
        for name, buffer in self.fields.items():
            value = getattr(kept, name)
            buffer[: value.shape[0], slot].copy_(value)


def own_rows_start(routed_rows: int, num_tokens: int, tokens_across_dp: list[int] | None, dp_rank: int) -> int:
    """Where this rank's ``num_tokens`` rows start among the ``routed_rows`` its routers saw. Under data parallelism
    with an all-gather dispatch, routers see every DP rank's tokens, rank by rank (``tokens_across_dp``, from
    vLLM's forward context): this rank's come after the lower ranks'. Otherwise (no DP, or a dispatch that routes
    before it gathers) they are the first rows, padding after them."""
    if not tokens_across_dp or len(tokens_across_dp) < 2:
        return 0
    if routed_rows == sum(tokens_across_dp) and routed_rows != tokens_across_dp[dp_rank]:
        return sum(tokens_across_dp[:dp_rank])
    if routed_rows < num_tokens:
        raise ValueError(f"routers saw {routed_rows} rows for {num_tokens} tokens of DP rank {dp_rank} "
                         f"(tokens across DP ranks: {tokens_across_dp})")
    return 0


class NothingCaptured(LookupError):
    """No capture mechanism wrote this forward's routing: recording it would record zeros."""


class RoutingCapture:
    """Where the routers' outputs are kept during forwards, and how rows of real tokens are collected after."""

    def __init__(
        self,
        max_tokens: int,
        num_layers: int,
        top_k: int,
        candidates: int,
        device: torch.device,
        graph_key: GraphKey = lambda: None,
    ):
        self.top_k, self.candidates, self.num_layers = top_k, candidates, num_layers
        self.graph_key = graph_key
        self.cuda = torch.device(device).type == "cuda"
        self.buffers = RoutingBuffers(max_tokens, num_layers, top_k, candidates, device)
        self.graphs: dict[Hashable, list[Kept | None]] = {}  # per captured graph: [L]
        self._graph_columns: dict[Hashable, list[torch.Tensor]] = {}  # per graph replayed: its columns, as views
        self.step: list[Kept | None] = [None] * num_layers  # this forward's, when the router's Python ran
        self.ran = False  # whether the routers' Python ran (and kept references in ``step``) since ``begin_step``
        self.traced = False  # Dynamo traced the wrapper: compiled forwards write the static buffers
        self.failed: str | None = None  # an error inside the forward, kept for the engine thread to report

    def keep(self, slot: int, kept: Kept) -> None:
        """Keep references to one layer's outputs: in the table of the graph being captured, or this step's."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            key = self.graph_key()
            self.graphs.setdefault(key, [None] * self.num_layers)[slot] = kept
            self._graph_columns.pop(key, None)
        else:
            self.step[slot] = kept
            self.ran = True

    def name_captured(self, key: Hashable) -> None:
        """File the routing kept during a capture whose graph had no name then (key None) under ``key``."""
        if None in self.graphs:
            self.graphs[key] = self.graphs.pop(None)
            self._graph_columns.pop(key, None)

    def begin_step(self) -> None:
        """Call before each forward: forget the previous forward's references (the last step's copy, queued on
        the same stream, has read them before anything can reuse their memory)."""
        if self.ran:  # most forwards replay a CUDA graph: nothing to forget
            self.step = [None] * self.num_layers
            self.ran = False

    def collect(self, num_tokens: int, replayed: Hashable | None = None, tokens_across_dp: list[int] | None = None,
                dp_rank: int = 0) -> tuple[str, list[torch.Tensor]]:
        """This rank's T rows of this forward as int32 columns [N, w] (floats by their bits), views on the device,
        its T rows first (N > T where a CUDA graph padded the forward: the padding rows follow, left for the caller
        to drop after packing, since slicing every column costs µs each): side by side they are the block
        [N, L*K ids | L*K weights | L*C cand_ids | L*C cand_scores] (layers in slot order); and the mechanism that
        wrote them (``eager``, ``graph`` or ``traced``). ``replayed`` names the CUDA
        graph the forward replayed (None: no graph); ``tokens_across_dp`` the tokens of every DP rank in this forward
        (None without DP). No kernel ran in the forward, and none runs here. Raises ``NothingCaptured`` when no
        mechanism wrote this forward."""
        mechanism, columns = self._columns(replayed, num_tokens)
        if mechanism == "traced" or tokens_across_dp is None:
            return mechanism, columns
        start = own_rows_start(columns[0].shape[0], num_tokens, tokens_across_dp, dp_rank)
        if start == 0:
            return mechanism, columns
        return mechanism, [column[start : start + num_tokens] for column in columns]

    def _columns(self, replayed: Hashable | None, num_tokens: int) -> tuple[str, list[torch.Tensor]]:
        """Which mechanism wrote this forward, and its int32 columns: each layer's [N, K or C] per field (N: the
        forward's padded length), or the static buffers' [T, L*K or L*C] per field (traced). A graph's columns are
        views of tensors that every replay rewrites in place: made once, at its first replay."""
        if replayed is not None and not self.ran:
            columns = self._graph_columns.get(replayed)
            if columns is not None:
                return "graph", columns
        mechanism, kept = self._kept(replayed)
        if kept is None:  # traced forward: the static buffers hold it
            return mechanism, [b[:num_tokens].reshape(num_tokens, -1).view(torch.int32)
                               for b in self.buffers.fields.values()]
        fields = [(name, getattr(k, name)) for name in self.buffers.fields for k in kept]
        columns = [tensor.to(_DTYPES[name]).view(torch.int32) for name, tensor in fields]  # floats by their bits
        if mechanism == "graph" and all(tensor.dtype == _DTYPES[name] for name, tensor in fields):
            self._graph_columns[replayed] = columns  # views of the graph's own outputs: valid at every replay
        return mechanism, columns

    def _kept(self, replayed: Hashable | None) -> tuple[str, list[Kept] | None]:
        """Which mechanism wrote this forward, with the references it left (None: the static buffers)."""
        if self.ran:
            mechanism, kept = "eager", self.step
        elif replayed is not None:
            mechanism, kept = "graph", self.graphs.get(replayed, [None])
        elif self.traced:
            return "traced", None
        else:
            raise NothingCaptured(
                "no router ran in this forward and no captured graph or compiled trace holds its routing "
                "(the MoE kernel may fuse routing, or this vLLM no longer calls _compute_routing)"
            )
        if any(k is None for k in kept):
            missing = "captured without the wrapper" if replayed is not None else "partly recorded"
            raise NothingCaptured(f"routing of this forward is incomplete (graph {replayed!r} {missing})")
        return mechanism, kept  # type: ignore[return-value]


def selection_scores(router: Any, router_logits: torch.Tensor) -> torch.Tensor:
    """The scores a router ranks experts by: the normalised score plus the selection bias, if any. [T, E]"""
    logits = router_logits.float()
    scores = logits.sigmoid() if router.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    bias = getattr(router, "e_score_correction_bias", None)
    return scores + bias.float() if bias is not None else scores


def record(capture: RoutingCapture, slot: int, router: Any, weights: torch.Tensor, ids: torch.Tensor,
           router_logits: torch.Tensor) -> None:
    """Inside the forward: keep layer ``slot``'s routing (and its top-C candidates) by the mechanism that runs.
    Never raises into the engine: an error is kept in ``capture.failed`` for the recorder to report."""
    if capture.failed is not None:
        return
    try:
        cand_ids = cand_scores = None
        if capture.candidates:
            cand_scores, cand_ids = selection_scores(router, router_logits).topk(capture.candidates, dim=-1)
        # Slice to top_k where fused shared experts append extra columns (ids >= E); a view costs µs, so only then.
        if ids.shape[1] > capture.top_k:
            ids, weights = ids[:, : capture.top_k], weights[:, : capture.top_k]
        kept = Kept(ids, weights, cand_ids, cand_scores)
        if torch.compiler.is_compiling():
            capture.traced = True  # runs at trace time: the compiled forward will write the buffers
            capture.buffers.write(slot, kept)  # traced: only tensor writes survive
        else:
            capture.keep(slot, kept)  # the Python runs: references, no kernel
    except Exception as exc:
        capture.failed = f"inside the forward, layer slot {slot}: {type(exc).__name__}: {exc}"


def wrap_router(router: Any, slot: int, capture: RoutingCapture,
                budget: tuple[TokenGroups, LayerBudget] | None = None, replay: ReplayedRouting | None = None) -> None:
    """Make ``router._compute_routing`` also record its result for layer ``slot``; with ``replay``, first route on
    the replayed trace's logits instead of the model's (``hooks.replay``); with ``budget``, then limit the result to
    the layer's budget in verification (``hooks.budget``; the candidates recorded stay the router's own choice).
    Idempotent."""
    if _WRAPPED_MARK in vars(router):
        return
    original: RoutingFn = router._compute_routing
    bias = getattr(router, "e_score_correction_bias", None)
    if replay is not None and isinstance(bias, torch.Tensor):
        with torch.no_grad():
            bias.zero_()  # the replayed scores already hold the recorded model's selection bias

    def compute_routing_and_capture(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positional = len(args) > 1
        router_logits = args[1] if positional else kwargs.get("router_logits")
        if replay is not None and capture.failed is None:
            try:
                router_logits = replay.logits(slot, router_logits)  # type: ignore[arg-type]
            except Exception as exc:
                capture.failed = f"inside the forward, replay into layer slot {slot}: {type(exc).__name__}: {exc}"
            else:
                args, kwargs = ((args[0], router_logits, *args[2:]), kwargs) if positional else (
                    args, {**kwargs, "router_logits": router_logits})
        weights, ids = original(*args, **kwargs)
        if budget is not None and capture.failed is None:
            try:
                weights, ids = restrict(*budget, router_logits, bias, weights, ids)  # type: ignore[arg-type]
            except Exception as exc:
                capture.failed = f"inside the forward, budget of layer slot {slot}: {type(exc).__name__}: {exc}"
        record(capture, slot, router, weights, ids, router_logits)  # type: ignore[arg-type]
        return weights, ids

    setattr(router, _WRAPPED_MARK, original)
    router._compute_routing = compute_routing_and_capture


def unwrap_router(router: Any) -> None:
    """Undo ``wrap_router``; a router that was never wrapped is left alone."""
    original = vars(router).pop(_WRAPPED_MARK, None)
    if original is None:
        return
    if getattr(original, "__func__", None) is getattr(type(router), "_compute_routing", None):
        del router._compute_routing  # the class method shows through again
    else:
        router._compute_routing = original


def wrap_logits_entry(owner: Any, name: str, router: Any, slot: int, capture: RoutingCapture) -> None:
    """For MoE kernels that fuse routing (they take the router logits and never call the router, e.g.
    FlashInfer's TRT-LLM MoE through ``routed_experts.forward_monolithic``): make ``owner.<name>``, the call that
    receives the logits, recompute the routing with the router's own ``_compute_routing`` (grouped top-k,
    selection bias, renormalisation, scaling) and record it. This adds the routing kernels to the forward again,
    but no host sync. Idempotent."""
    if _ENTRY_MARK in vars(owner):
        return
    original = getattr(owner, name)
    compute: RoutingFn = router._compute_routing

    def entry_and_recompute(*args: Any, **kwargs: Any) -> Any:
        if capture.failed is None:
            try:
                hidden = kwargs.get("x", kwargs.get("hidden_states", args[0] if args else None))
                logits = kwargs["router_logits"] if "router_logits" in kwargs else args[1]
                weights, ids = compute(hidden, logits, None, input_ids=kwargs.get("input_ids"))
                record(capture, slot, router, weights, ids, logits)
            except Exception as exc:
                capture.failed = f"inside the forward, layer slot {slot}: {type(exc).__name__}: {exc}"
        return original(*args, **kwargs)

    setattr(owner, _ENTRY_MARK, name)
    setattr(owner, name, entry_and_recompute)


def unwrap_logits_entry(owner: Any) -> None:
    """Undo ``wrap_logits_entry``; an owner that was never wrapped is left alone."""
    name = vars(owner).pop(_ENTRY_MARK, None)
    if name is not None:
        delattr(owner, name)  # the class method shows through again


def router_info(runner: Any) -> RouterInfo:
    router = runner.router
    return RouterInfo(
        layer=int(runner.layer_id),
        num_experts=int(router.global_num_experts),
        top_k=int(router.top_k),
        scoring_func=str(getattr(router, "scoring_func", "softmax")),
        routed_scaling_factor=float(getattr(router, "routed_scaling_factor", 1.0)),
    )


def logits_entries(runners: list[Any], everywhere: bool) -> list[tuple[Any, str] | None]:
    """Per MoE layer, where its routing is recomputed from the router logits (None: its router is wrapped): a kernel
    that fuses routing never calls the router (``everywhere``: every layer, to check that path against the wrapped
    one). The entry is the fused kernel (monolithic), else the router."""
    entries: list[tuple[Any, str] | None] = []
    for moe in runners:
        entry = None
        if moe.is_monolithic or everywhere:
            entry = (moe.routed_experts, "forward_monolithic") if moe.is_monolithic else (moe.router, "select_experts")
            require_fields(entry[0], (entry[1],), "MoE layer")
        entries.append(entry)
    return entries


def wrap_layers(runners: list[Any], entries: list[tuple[Any, str] | None], capture: RoutingCapture,
                changes: Callable[[int], tuple[tuple[TokenGroups, LayerBudget] | None, ReplayedRouting | None]] | None
                ) -> None:
    """Record every MoE layer's routing: its router wrapped (with what ``changes`` its routing, per layer: a budget,
    a replay), or its logits entry where it has one (``logits_entries``). Idempotent."""
    for slot, (moe, entry) in enumerate(zip(runners, entries)):
        if entry is None:
            wrap_router(moe.router, slot, capture, *(changes(slot) if changes is not None else (None, None)))
        else:
            wrap_logits_entry(entry[0], entry[1], moe.router, slot, capture)


def unwrap_layers(runners: list[Any], entries: list[tuple[Any, str] | None]) -> None:
    """Undo ``wrap_layers``."""
    for moe, entry in zip(runners, entries):
        unwrap_router(moe.router)
        if entry is not None:
            unwrap_logits_entry(entry[0])
