"""Backward split into an input-gradient pass and a deferred weight-gradient pass (zero bubble).

``backward_input`` computes d(loss)/d(stage input) only, keeping the graph. While it
runs, hooks capture the gradient arriving at every *junction*: an autograd node on the
path from the stage output to the stage input that also feeds a parameter branch
(e.g. the ``AddmmBackward`` of a Linear: its input-path edge leads on to the input,
its other edges to the weight and bias). ``backward_weight`` later restarts autograd
at those junctions with the captured gradients and asks only for the parameters, so it
runs just the parameter branches (autograd skips outputs nobody asked for: each mm
node computes ``dW`` and not ``dX`` again). The two passes together give exactly the
gradients of one full backward.

Parameters joined by a junction (or sharing one) form one group, run by one
``torch.autograd.grad`` call. When one junction of a group lies downstream of another,
a pre-hook pins its incoming gradient to the captured value so nothing is counted twice.

Without a stage input that requires grad (the first stage: token ids) there is no input
path; the input pass is empty and the weight pass is the whole backward.

Autograd functions whose one backward computes both the input and the weight gradient
(the FP8 linear, engine.precision.fp8) ask :func:`backward_phase` (engine.precision.backward_phase) which half is running and
compute only that half, so the junction's backward does not run its GEMMs twice.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from engine.precision.backward_phase import backward_phase
from engine.precision.backward_phase import in_phase as _in_phase

__all__ = ["SavedStore", "WeightGradState", "backward_input", "backward_weight", "full_backward", "backward_phase"]

Root = Union[torch.Tensor, GradientEdge]


@dataclass
class _Group:
    params: list[torch.nn.Parameter]
    junctions: list[Node]
    grads: dict[int, tuple] = field(default_factory=dict)  # junction index -> captured grad_outputs


class SavedStore:
    """The tensors one chunk's forward saved for backward, held here instead of in autograd's
    nodes (``saved_tensors_hooks``: a node keeps only a key), so that after the input pass the
    ones only the input path needs can be dropped (:meth:`drop_input_only`).

    Why: the input pass keeps the graph (``retain_graph``) for the weight pass, which by
    default keeps EVERY saved tensor from the chunk's ``I`` to its ``W``: attention's and the
    activations' internals too, which only the input gradient reads. The weight pass needs only
    what its junctions and parameter branches saved (a Linear's input, a norm's normalised
    tensor). Between a chunk's ``I`` and ``W`` (the zero-bubble schedules defer W), that is what
    the chunk costs, beside the captured gradients.

    Which node reads which key is recorded during the input pass: each node of the chunk's
    graph gets a pre-hook naming it the running node (autograd runs a node's pre-hooks, then
    the node, which unpacks its saved tensors, on one thread)."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.readers: Optional[dict[int, set[Node]]] = None  # key -> nodes that read it (input pass)
        self._running = threading.local()
        self.dropped = 0  # keys dropped after the input pass (for tests)
        self._next_key = 0

    def hooks(self) -> Any:
        """The context manager to run the chunk's forward in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int:
        key = self._next_key
        self._next_key += 1
        # a detached alias (same storage and version counter, as autograd's own saved copy):
        # keeping the tensor itself would keep an output's grad_fn, which holds this key (a cycle)
        self.tensors[key] = t.detach()
        return key

    def _unpack(self, key: int) -> torch.Tensor:
        if self.readers is not None:
            node = getattr(self._running, "node", None)
            if node is not None:
                self.readers.setdefault(key, set()).add(node)
        t = self.tensors.get(key)
        if t is None:
            raise RuntimeError("a tensor saved for backward was dropped after the input pass but the weight pass "
                               "reads it (engine.pipeline.split_backward.SavedStore): please report this graph")
        return t

    def record(self, nodes: set[Node]) -> list[Any]:
        """Start recording readers: pre-hooks on ``nodes`` (returns their handles)."""
        self.readers = {}

        def running(_grad_outputs: Any, node: Node) -> None:
            self._running.node = node

        return [n.register_prehook(lambda go, n=n: running(go, n)) for n in nodes]

    def drop_input_only(self, keep_readers: set[Node]) -> None:
        """Drop the tensors read during the input pass by no node in ``keep_readers`` (those the
        weight pass may run); tensors nobody read stay (parameter branches read them in W)."""
        assert self.readers is not None  # record() was called before the input pass
        for key, nodes in self.readers.items():
            if key in self.tensors and nodes.isdisjoint(keep_readers):
                del self.tensors[key]
                self.dropped += 1
        self.readers = None
        self._running.node = None


@dataclass
class WeightGradState:
    """What :func:`backward_weight` needs; holds the graph alive until then."""

    groups: list[_Group]
    root: Optional[Root] = None  # set when the weight pass must be a full backward
    root_grad: Optional[torch.Tensor] = None


def _reverse_edges(root: Node) -> dict[Node, list[Node]]:
    """node -> the nodes that feed gradient into it (its consumers in the forward)."""
    rev: dict[Node, list[Node]] = defaultdict(list)
    seen, q = {root}, deque([root])
    while q:
        node = q.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            rev[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                q.append(nxt)
    return rev


def _upstream(starts: Sequence[Node], rev: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` towards the output, not crossing ``stop`` (those met are returned too)."""
    seen, met, q = set(starts), set(), deque(starts)
    while q:
        for up in rev.get(q.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                q.append(up)
    return seen, met


def _groups(root: Node, input_node: Node, params: Sequence[torch.nn.Parameter],
            rev: Optional[dict[Node, list[Node]]] = None) -> list[_Group]:
    rev = _reverse_edges(root) if rev is None else rev
    on_input_path, _ = _upstream([input_node], rev, stop=set())
    # union-find of parameters through shared junctions
    owner: dict[Node, int] = {}
    groups: list[_Group] = []
    for p in params:
        node = get_gradient_edge(p).node
        if node not in rev:
            continue  # this parameter did not take part in the forward of this microbatch
        _, junctions = _upstream([node], rev, stop=on_input_path)
        hit = {owner[j] for j in junctions if j in owner}
        g = _Group([p], list(junctions))
        for idx in sorted(hit):  # merge every group this one touches into it
            other = groups[idx]
            g.params += other.params
            g.junctions += [j for j in other.junctions if j not in g.junctions]
            other.params, other.junctions = [], []
        groups.append(g)
        for j in g.junctions:
            owner[j] = len(groups) - 1
    return [g for g in groups if g.params]


def _downstream(starts: Sequence[Node]) -> set[Node]:
    """``starts`` and every node they feed gradient to (towards the leaves)."""
    seen, q = set(starts), deque(starts)
    while q:
        for nxt, _ in q.popleft().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                q.append(nxt)
    return seen


def _weight_pass_nodes(groups: Sequence[_Group], rev: dict[Node, list[Node]]) -> set[Node]:
    """The nodes :func:`backward_weight` may run: below a group's junctions and above one of
    its parameters (the junctions, the parameter branches, and the input-path nodes between
    two junctions of one group, whose outputs the pins discard)."""
    out: set[Node] = set()
    for g in groups:
        acc = [get_gradient_edge(p).node for p in g.params]
        above, _ = _upstream(acc, rev, stop=set())
        out |= above & _downstream(g.junctions)
    return out


def full_backward(root: Root, grad: Optional[torch.Tensor]) -> None:
    """One ordinary backward from ``root`` (a tensor or the GradientEdge of a freed output)."""
    torch.autograd.backward(root, grad_tensors=None if grad is None else [grad])


def backward_input(root: Root, grad: Optional[torch.Tensor], stage_input: Optional[torch.Tensor],
                   params: Sequence[torch.nn.Parameter],
                   saved: Optional[SavedStore] = None) -> tuple[Optional[torch.Tensor], WeightGradState]:
    """d(root)/d(stage_input) (None without an input that requires grad) and the state for W.

    ``grad`` is d(loss)/d(output) (None when ``root`` is the scalar loss itself). ``saved``:
    the store the chunk's forward saved its tensors in; those only the input pass reads are
    dropped after it (:class:`SavedStore`).
    """
    if stage_input is None or not stage_input.requires_grad:
        return None, WeightGradState([], root=root, root_grad=grad)
    root_node = root.node if isinstance(root, GradientEdge) else root.grad_fn
    assert root_node is not None  # the root depends on stage_input, which requires grad
    rev = _reverse_edges(root_node)
    groups = _groups(root_node, get_gradient_edge(stage_input).node, [p for p in params if p.requires_grad], rev)
    handles = [] if saved is None else saved.record(set(rev) | {root_node})
    for g in groups:
        for i, j in enumerate(g.junctions):
            def capture(grad_outputs, g=g, i=i):
                g.grads[i] = tuple(grad_outputs)
            handles.append(j.register_prehook(capture))
    try:
        with _in_phase("input"):
            # torch's stub takes a sequence of Tensors or of GradientEdges, not a list typed with both
            (dx,) = torch.autograd.grad([root], [stage_input],  # type: ignore[arg-type]
                                        grad_outputs=None if grad is None else [grad], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    if saved is not None:
        saved.drop_input_only(_weight_pass_nodes(groups, rev))
    return dx, WeightGradState(groups)


def backward_weight(state: WeightGradState,
                    gather: Optional[Callable[[list[torch.nn.Parameter]], None]] = None) -> None:
    """Accumulate the parameter gradients into ``.grad`` (the deferred half of the backward).

    ``gather(params)``: makes ``params`` whole before their gradients are accumulated (ZeRO-3
    releases a unit between uses; the weight pass restarts below the unit's pre-backward
    hook, so it would otherwise meet the empty placeholder). Called on every rank of the
    data-parallel group in the same order, since every replica runs the same schedule."""
    if state.root is not None:
        full_backward(state.root, state.root_grad)
        state.root = state.root_grad = None
        return
    for g in state.groups:
        edges, grads, pins = [], [], []
        for i, j in enumerate(g.junctions):
            captured = g.grads.get(i)
            if captured is None:
                continue  # no gradient reached this junction: nothing flows to its parameters
            for k, t in enumerate(captured):
                if t is not None:
                    edges.append(GradientEdge(j, k))
                    grads.append(t)
            if len(g.junctions) > 1:
                pins.append(j.register_prehook(lambda _go, c=captured: c))
        try:
            if edges:
                if gather is not None:
                    gather(g.params)
                # through the parameters' AccumulateGrad nodes, so .grad hooks (ZeRO) fire
                with _in_phase("weight"):
                    torch.autograd.backward(edges, grad_tensors=grads, inputs=g.params, retain_graph=True)
        finally:
            for h in pins:
                h.remove()
    state.groups = []
