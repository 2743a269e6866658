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

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from engine.precision.backward_phase import backward_phase
from engine.precision.backward_phase import in_phase as _in_phase

__all__ = ["WeightGradState", "backward_input", "backward_weight", "full_backward", "backward_phase"]

Root = Union[torch.Tensor, GradientEdge]


@dataclass
class _Group:
    params: list[torch.nn.Parameter]
    junctions: list[Node]
    grads: dict[int, tuple] = field(default_factory=dict)  # junction index -> captured grad_outputs


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


def _groups(root: Node, input_node: Node, params: Sequence[torch.nn.Parameter]) -> list[_Group]:
    rev = _reverse_edges(root)
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


def full_backward(root: Root, grad: Optional[torch.Tensor]) -> None:
    """One ordinary backward from ``root`` (a tensor or the GradientEdge of a freed output)."""
    torch.autograd.backward(root, grad_tensors=None if grad is None else [grad])


def backward_input(root: Root, grad: Optional[torch.Tensor], stage_input: Optional[torch.Tensor],
                   params: Sequence[torch.nn.Parameter]) -> tuple[Optional[torch.Tensor], WeightGradState]:
    """d(root)/d(stage_input) (None without an input that requires grad) and the state for W.

    ``grad`` is d(loss)/d(output) (None when ``root`` is the scalar loss itself).
    """
    if stage_input is None or not stage_input.requires_grad:
        return None, WeightGradState([], root=root, root_grad=grad)
    root_node = root.node if isinstance(root, GradientEdge) else root.grad_fn
    assert root_node is not None  # the root depends on stage_input, which requires grad
    groups = _groups(root_node, get_gradient_edge(stage_input).node, [p for p in params if p.requires_grad])
    handles = []
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
