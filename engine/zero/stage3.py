"""ZeRO stage 3: parameters sharded too, gathered on use.

Each submodule that owns parameters is a *unit*: its parameters (per group key) form flat
buckets partitioned over DP, and between uses a rank holds only its compute-dtype chunk
(``compute_shard``) plus the fp32 master shard (in fp32 they are one tensor); ``p.data`` is
an empty placeholder.

- forward pre-hook: gather the unit (all-gather of the chunks into a full buffer, the
  parameters become views of it), then prefetch the units that came next in the first
  step's recorded order, bounded by ``prefetch_bucket_size`` elements in flight and
  ``max_live_parameters`` elements gathered;
- forward post-hook: release the unit (unless it is used again soon, below), and wrap its
  outputs in an identity autograd node whose backward gathers the unit again (pre-backward);
- after backward: when every parameter of the unit has delivered its gradient in this
  backward pass (post-accumulate-grad hooks), release it again.

``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``): a unit whose next use in
the recorded order comes after fewer than this many elements of other units' gathers stays
gathered instead (e.g. the last blocks from their forward to their backward), within
``max_live_parameters``; 0 releases after every use. Everything is released at the end of
the step's backward.

A parameter owned by several units (a tied embedding and LM head) would otherwise receive
its gradient only after every use contributed: autograd would hold the first use's full
(V, H) contribution, and keep that unit gathered, through the whole backward in between.
Instead each forward use of such a unit finds the autograd nodes it created that feed the
shared parameter's ``AccumulateGrad`` and hooks them (node post-hooks): each use's
contribution is taken from autograd as soon as it is computed and reduce-scattered into the
gradient shard (and waited for) once autograd has let go of the node's buffers, and the unit
is released once all of its use's nodes have run (and no other use's backward is under
way). Cost: one reduce-scatter of the shared parameter per use instead of one per backward.
This relies on the autograd engine running a unit's nodes between that use's pre-backward
and its hooked nodes, as the release-after-a-unit's-backward of DeepSpeed and FSDP does.

Because every use is preceded by its own gather, a module may run forward for several
micro-batches before their backwards (pipeline micro-batches in flight): each forward and
each backward gathers and releases independently. Parameters of at most
``param_persistence_threshold`` elements stay whole and are handled as in stage 2.
Gradients are handled exactly as in stage 2. A parameter owned by several modules (weight
sharing within a stage) gets a bucket of its own that each owner gathers.

Memory per rank between steps: (2 + 4 + 12) Psi / N_d (+ persistent parameters); in fp32
(4 + 4 + 8) Psi / N_d, the compute shard being the master shard.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Optional, Union

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.zero.buckets import FlatBucket
from engine.zero.external import external_parameters, unwatch_parameters, watch_parameters
from engine.zero.init import gather_partitioned, is_partitioned, param_numel, register_managed
from engine.zero.offload import host_zeros
from engine.zero.partition import GroupKey, bucketize
from engine.zero.stage2 import Zero2Optimizer

__all__ = ["Zero3Optimizer"]


def _forget_partition(p: object) -> None:
    """The optimizer's buckets hold the values now: drop :class:`engine.zero.Init`'s shard."""
    for name in ("ds_tensor", "ds_numel", "ds_shape", "ds_process_group"):
        if hasattr(p, name):
            delattr(p, name)


def _resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """Resize ``t``'s storage in place to ``nbytes`` (0 frees it; views keep their metadata).
    Through the dispatcher (the op FSDP2 uses) so memory trackers see it."""
    torch.ops.inductor.resize_storage_bytes_(t, nbytes)


def _empty_storage_buffer(b: FlatBucket) -> torch.Tensor:
    """A (padded,) tensor of ``b``'s dtype whose storage holds no memory yet."""
    buf = torch.empty(b.layout.padded_numel, dtype=b.dtype, device=b.device)
    _resize_storage(buf, 0)
    return buf


def _next_sequence_nr() -> int:
    """A number above every autograd node created so far on this thread and below every
    later one (the sequence number of a throwaway node, plus one)."""
    probe = torch.empty(0, requires_grad=True).view(0)
    assert probe.grad_fn is not None  # a view of a tensor requiring grad has a ViewBackward
    return int(probe.grad_fn._sequence_nr()) + 1


def _tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in a module output (nested tuples, lists, dicts, dataclasses: an MoE
    router returns one, and a tensor left unwrapped would reach its backward ungathered)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors_in(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors_in(y)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _tensors_in(getattr(x, f.name))]
    return []


class _SharedUse:
    """One forward use of a unit owning shared parameters: how many of the autograd nodes it
    created that produce a shared parameter's gradient have yet to run, and whether its
    backward has begun (its pre-backward gathered the unit) and not yet ended."""

    __slots__ = ("remaining", "open")

    def __init__(self, remaining: int):
        self.remaining = remaining
        self.open = False


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward gathers the unit before the unit's own
    backward nodes run (they consume the gradient this node passes on)."""

    @staticmethod
    def forward(ctx, opt: "Zero3Optimizer", unit: torch.nn.Module, use: Optional[_SharedUse], *tensors: torch.Tensor):
        ctx.opt, ctx.unit, ctx.use = opt, unit, use
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.opt._pre_backward(ctx.unit, ctx.use)
        return (None, None, None) + grads


class Zero3Optimizer(Zero2Optimizer):
    stage = 3

    def __init__(self, params: Any, optimizer_factory: Any, groups: Union[ParallelGroups, AxisGroup], *, module: torch.nn.Module,
                 prefetch_bucket_size: int = 50_000_000, max_live_parameters: int = 1_000_000_000,
                 param_persistence_threshold: int = 100_000, max_reuse_distance: int = 0, **kwargs: Any):
        self.module = module
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live_parameters = int(max_live_parameters)
        self.max_reuse_distance = int(max_reuse_distance)
        self.persistence_threshold = int(param_persistence_threshold)
        self._owners: dict[int, list[torch.nn.Module]] = {}
        for m in module.modules():
            # a parameter registered as external to m (register_external_parameter) is m's too
            for p in list(m.parameters(recurse=False)) + external_parameters(m):
                owners = self._owners.setdefault(id(p), [])
                if m not in owners:
                    owners.append(m)
        super().__init__(params, optimizer_factory, groups, **kwargs)
        # unit (module) -> its non-persistent buckets; param id -> units owning it
        self._units: dict[torch.nn.Module, list[FlatBucket]] = {}
        self._units_of: dict[int, list[torch.nn.Module]] = {}
        for b in self.buckets:
            if b.persistent:
                continue
            for p in b.params:
                for m in self._owners[id(p)]:
                    if b not in self._units.setdefault(m, []):
                        self._units[m].append(b)
                    self._units_of.setdefault(id(p), []).append(m)
        register_managed([p for b in self.buckets if not b.persistent for p in b.params], self)
        self._unit_size = {m: len({id(p) for b in bs for p in b.params}) for m, bs in self._units.items()}
        # unit -> its parameters that other units own too (their gradients are taken per use)
        self._shared: dict[torch.nn.Module, list[torch.nn.Parameter]] = {}
        for m, bs in self._units.items():
            shared = [p for b in bs for p in b.params if len(self._units_of[id(p)]) > 1]
            if shared:
                self._shared[m] = shared
        self._use_start: dict[torch.nn.Module, list[Optional[int]]] = {m: [] for m in self._shared}
        self._deferred: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (param, one use's gradient)
        self._open_uses: dict[torch.nn.Module, int] = {m: 0 for m in self._shared}  # backwards begun, not ended
        self._fired: dict[torch.nn.Module, set[int]] = {m: set() for m in self._units}
        self._live_numel = 0
        self._trace: list[torch.nn.Module] = []
        self._tracing = True
        self._trace_pos = 0
        # once the trace is recorded: each bucket's trace positions (ascending) and the elements
        # gathered by the uses before position i (a prefix sum)
        self._bucket_uses: dict[int, list[int]] = {}
        self._gathered_before: list[int] = []
        self._last_use: dict[torch.nn.Module, Optional[int]] = {}  # this pass's trace position of each unit
        self.gather_count = 0  # all-gathers launched (demand + prefetch), for tests and logs
        self.prefetch_count = 0
        for m in self._units:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        self.forward_depth = 0  # modules of self.module in forward (engine.zero.external)
        self._hooks += watch_parameters(self.module, self, set(self._where))

    # ------------------------------------------------------------------ external uses
    def gather_external(self, param: torch.Tensor) -> None:
        """``param`` was read outside its owners' forward (engine.zero.external): gather its
        bucket now. It is released by its owners' gradient accounting (all of the unit's
        gradients in) or at the end of the step's backward (:meth:`_release_all`)."""
        where = self._where.get(id(param))
        if where is None or where[0].persistent:
            return
        self._materialize(where[0])

    def remove_hooks(self) -> None:
        super().remove_hooks()
        unwatch_parameters(self.module)

    # ------------------------------------------------------------------ layout
    def _plan_buckets(self, key: GroupKey, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        for p in params:
            if id(p) not in self._owners:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not in the module given to "
                                 f"ZeRO stage 3; pass the module that owns every optimized parameter")
        small = [p for p in params if param_numel(p) <= self.persistence_threshold]
        large = [p for p in params if param_numel(p) > self.persistence_threshold]
        if key.tied_index >= 0:  # same layout on every stage holding the tied weight
            return [[p] for p in params]
        plans = [[small[i] for i in idx] for idx in bucketize([param_numel(p) for p in small], self.reduce_bucket_size)]
        by_unit: dict[Any, list[torch.nn.Parameter]] = {}
        for p in large:
            owners = self._owners[id(p)]
            unit_key = id(owners[0]) if len(owners) == 1 else ("shared", id(p))
            by_unit.setdefault(unit_key, []).append(p)
        return plans + list(by_unit.values())

    def _init_bucket(self, b: FlatBucket) -> None:
        b.persistent = b.layout.numels[0] <= self.persistence_threshold
        if b.persistent:
            for p in b.params:  # small: whole on every rank, as in stage 2
                if is_partitioned(p):
                    p.data = gather_partitioned(p).clone()
                    _forget_partition(p)
            super()._init_bucket(b)
            return
        b.compute_shard = self._compute_shard(b)
        b.shard_master.copy_(b.compute_shard)
        if b.dtype == torch.float32 and self.offload.optimizer == self.offload.param:
            # fp32 training: the compute shard IS the master shard (same values after every
            # step), as fp32 parameters are the master weights at stage 0; 4 Psi / N bytes saved
            # (both on the device, or both on the host with offload_optimizer + offload_param)
            b.compute_shard = b.shard_master
        b.unbind()
        b.gather_buf = _empty_storage_buffer(b)

    def _compute_shard(self, b: FlatBucket) -> torch.Tensor:
        """This rank's (shard,) chunk of the bucket. Parameters built under
        :class:`engine.zero.Init` are gathered one at a time (every rank, same order: a
        collective per parameter), so no rank ever holds more than one whole parameter."""
        lo, hi = b.layout.shard_range(b.shard_index)
        # offload_param: the shard lives on the host (engine.zero.offload), copied to the device per gather
        shard = (host_zeros(hi - lo, b.dtype, self.offload.pin_memory) if self.offload.param
                 else torch.zeros(hi - lo, dtype=b.dtype, device=b.device))
        for i, p in enumerate(b.params):
            full = gather_partitioned(p) if is_partitioned(p) else p.detach()
            flat = full.reshape(-1)
            plo, phi = b.layout.param_range(i)
            a, z = max(plo, lo), min(phi, hi)
            if a < z:
                shard[a - lo:z - lo].copy_(flat[a - plo:z - plo])
            _forget_partition(p)
            del full, flat
        return shard

    def _start_gather(self, b: FlatBucket) -> None:
        full = b.gather_buf
        assert full is not None and b.compute_shard is not None  # set for every ZeRO-3 bucket (_init_bucket)
        _resize_storage(full, b.layout.padded_numel * full.element_size())
        send = self._host.to_device(b.compute_shard, b.dtype) if self.offload.param else b.compute_shard
        work = comm.all_gather(full, send, b.reduce_group, async_op=True)
        b.pending = (full, work)
        self._live_numel += b.layout.padded_numel
        self.gather_count += 1

    def _materialize(self, b: FlatBucket) -> None:
        if b.full is not None:
            return
        if b.pending is None:
            self._start_gather(b)
        assert b.pending is not None  # set by _start_gather
        full, work = b.pending
        if work is not None:
            work.wait()
        b.pending = None
        b.bind(full)

    def _release_bucket(self, b: FlatBucket, keep_aliases: bool = False) -> None:
        """Unbind ``b``'s parameters and free its gathered buffer. Within training the
        storage is resized to 0 in place (autograd's saved views of the parameters see the
        re-gathered values in backward). ``keep_aliases`` (GatheredParameters' exit, as
        DeepSpeed's ``param.data = empty``): the bucket takes a fresh empty buffer and drops
        its reference to the old one, which is freed at once unless the user holds a view of
        it (a ``state_dict()`` tensor), which then keeps its values."""
        if b.pending is not None:
            work = b.pending[1]
            if work is not None:
                work.wait()
            b.pending = None
        elif b.full is None:
            return
        b.unbind()
        assert b.gather_buf is not None  # set for every ZeRO-3 bucket (_init_bucket)
        if keep_aliases:
            b.gather_buf = _empty_storage_buffer(b)
        else:
            _resize_storage(b.gather_buf, 0)
        self._live_numel -= b.layout.padded_numel

    def _fetch_unit(self, unit: torch.nn.Module) -> None:
        self._advance_trace(unit)
        for b in self._units[unit]:
            self._materialize(b)
        self._prefetch()

    def _release_unit(self, unit: torch.nn.Module) -> None:
        """After a use: release the unit's buckets but those reused soon (``_reused_soon``)."""
        self._fired[unit].clear()
        for b in self._units[unit]:
            if not self._reused_soon(unit, b):
                self._release_bucket(b)

    def _drop_unit(self, unit: torch.nn.Module) -> None:
        for b in self._units[unit]:
            self._release_bucket(b)
        self._fired[unit].clear()

    def _release_all(self) -> None:
        for unit in self._units:
            self._drop_unit(unit)
        for unit in self._open_uses:  # backward is over (or not begun): no use is open
            self._open_uses[unit] = 0

    def _reused_soon(self, unit: torch.nn.Module, b: FlatBucket) -> bool:
        """Whether bucket ``b``'s next use (by any unit owning it) in the recorded order follows
        ``unit``'s current use after fewer than ``max_reuse_distance`` gathered elements, and
        keeping it stays within ``max_live_parameters`` (DeepSpeed's per-parameter reuse rule)."""
        if self.max_reuse_distance <= 0 or self._tracing or self._live_numel > self.max_live_parameters:
            return False
        i = self._last_use.get(unit)
        if i is None:
            return False
        uses = self._bucket_uses[b.index]
        k = bisect.bisect_right(uses, i)
        if k == len(uses):
            return False
        return self._gathered_before[uses[k]] - self._gathered_before[i + 1] < self.max_reuse_distance

    # ------------------------------------------------------------------ prefetch
    def _advance_trace(self, unit: torch.nn.Module) -> None:
        """Record the fetch order during the first step; afterwards follow it."""
        if self._tracing:
            self._trace.append(unit)
            return
        trace, pos = self._trace, self._trace_pos
        if pos < len(trace) and trace[pos] is unit:
            self._trace_pos = pos + 1
            self._last_use[unit] = pos
            return
        for i in range(pos, len(trace)):  # the order changed: resynchronise or stop prefetching
            if trace[i] is unit:
                self._trace_pos = i + 1
                self._last_use[unit] = i
                return
        self._trace_pos = len(trace)
        self._last_use[unit] = None  # off the recorded order: no reuse known

    def _index_trace(self) -> None:
        """Each bucket's use positions and the gathered-element prefix sums of the recorded trace."""
        self._bucket_uses, self._gathered_before = {}, [0]
        for i, m in enumerate(self._trace):
            for b in self._units[m]:
                self._bucket_uses.setdefault(b.index, []).append(i)
            self._gathered_before.append(self._gathered_before[-1] + sum(b.layout.padded_numel for b in self._units[m]))

    def _prefetch(self) -> None:
        if self._tracing or self.prefetch_bucket_size <= 0:
            return
        in_flight = sum(b.layout.padded_numel for b in self.buckets if b.pending is not None)
        for unit in self._trace[self._trace_pos:]:
            for b in self._units[unit]:
                if b.full is not None or b.pending is not None:
                    continue
                n = b.layout.padded_numel
                if in_flight + n > self.prefetch_bucket_size or self._live_numel + n > self.max_live_parameters:
                    return
                self._start_gather(b)
                self.prefetch_count += 1
                in_flight += n

    # ------------------------------------------------------------------ module hooks
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._fetch_unit(module)
        if module in self._shared:  # a stack: a unit may run inside its own forward
            self._use_start[module].append(_next_sequence_nr() if torch.is_grad_enabled() else None)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        start = self._use_start[module].pop() if self._use_start.get(module) else None
        if torch.is_grad_enabled():
            use = self._hook_shared_uses(module, output, start) if start is not None else None
            output = self._wrap_outputs(module, output, use)
        self._release_unit(module)
        return output

    def _hook_shared_uses(self, unit: torch.nn.Module, output: Any, start: int) -> Optional[_SharedUse]:
        """Hook the nodes this forward of ``unit`` created (sequence numbers in [start, end))
        that feed a shared parameter's ``AccumulateGrad``, so that this use's contribution is
        taken when it is computed (:meth:`_on_use_grad`)."""
        end = _next_sequence_nr()
        targets = {id(p) for p in self._shared[unit]}
        edges: dict[Any, list[tuple[int, torch.nn.Parameter]]] = {}
        seen: set[Any] = set()
        stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen or not start <= node._sequence_nr() < end:
                continue
            seen.add(node)
            for k, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # AccumulateGrad nodes only
                if var is not None:
                    if id(var) in targets:
                        edges.setdefault(node, []).append((k, var))
                elif nxt not in seen:
                    stack.append(nxt)
        if not edges:
            return None
        use = _SharedUse(len(edges))
        for node, where in edges.items():
            node.register_hook(functools.partial(self._on_use_grad, unit, use, where))
        return use

    def _on_use_grad(self, unit: torch.nn.Module, use: _SharedUse, where: list[tuple[int, torch.nn.Parameter]],
                     grad_inputs: tuple[Optional[torch.Tensor], ...],
                     grad_outputs: tuple[Optional[torch.Tensor], ...]) -> tuple[Optional[torch.Tensor], ...]:
        """Node post-hook: hand this use's gradient of each shared parameter to its bucket
        (the node passes nothing on to ``AccumulateGrad``); when the use's last such node has
        run, the unit's shared parameters count as delivered for its release (unless the
        backward of another use of the unit has begun and not ended). The contribution is
        reduced after the hook returns (:meth:`_flush_deferred`)."""
        self._flush_deferred()
        use.remaining -= 1
        if use.remaining == 0:  # the use's last node has run: its gathered values are not needed
            if use.open:
                use.open = False
                self._open_uses[unit] -= 1
            fired = self._fired[unit]
            fired.update(id(p) for p in self._shared[unit])
            if len(fired) == self._unit_size[unit] and self._open_uses[unit] == 0:
                self._release_unit(unit)
        out = list(grad_inputs)
        for k, p in where:
            g = out[k]
            if g is None:
                continue
            out[k] = None
            others = {t.untyped_storage()._cdata for j, t in enumerate(grad_inputs + grad_outputs)
                      if t is not None and j != k}
            if g._base is not None or g.untyped_storage()._cdata in others:
                g = g.clone(memory_format=torch.contiguous_format)  # autograd may pass it on elsewhere
            if not self._deferred:
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_deferred)  # end of this backward
            self._deferred.append((p, g))
        return tuple(out)

    def _wrap_outputs(self, unit: torch.nn.Module, output: Any, use: Optional[_SharedUse] = None) -> Any:
        flat = [t for t in _tensors_in(output) if t.requires_grad]
        if not flat:
            return output
        wrapped = dict(zip(map(id, flat), _PreBackward.apply(self, unit, use, *flat)))

        def rebuild(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return wrapped.get(id(x), x)
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
                return type(x)(*(rebuild(y) for y in x))
            if isinstance(x, (list, tuple)):
                return type(x)(rebuild(y) for y in x)
            if isinstance(x, dict):
                return type(x)((k, rebuild(v)) for k, v in x.items())
            if dataclasses.is_dataclass(x) and not isinstance(x, type):  # frozen ones too
                return dataclasses.replace(x, **{f.name: rebuild(getattr(x, f.name))
                                                 for f in dataclasses.fields(x) if f.init})
            return x

        return rebuild(output)

    def _flush_deferred(self) -> None:
        """Reduce-scatter the shared-parameter contributions :meth:`_on_use_grad` took, and
        wait: once its hook has returned, autograd has let go of the node's own buffers (the
        one a transposed gradient is a view of), so at most one (V, H)-sized copy and, on
        gloo, the backend's copy of it are alive; in flight they would stay alive through the
        next units' backward."""
        while self._deferred:
            p, g = self._deferred.pop(0)
            b, i = self._where[id(p)]
            self._reduced = False
            self._on_grad_sharded(b, i, p, self._grad_factor(), grad=g)
            del g
            self._drain_through(b)

    def _pre_backward(self, unit: torch.nn.Module, use: Optional[_SharedUse] = None) -> None:
        self._flush_deferred()
        self._fetch_unit(unit)
        self._fired[unit].clear()  # count this backward pass's gradients from here
        if use is not None and use.remaining > 0 and not use.open:
            use.open = True
            self._open_uses[unit] += 1

    def _on_grad(self, p: torch.Tensor) -> None:
        self._flush_deferred()
        if p.grad is not None:  # None: every use's contribution was taken by _on_use_grad
            super()._on_grad(p)
        for unit in self._units_of.get(id(p), ()):
            fired = self._fired[unit]
            fired.add(id(p))
            if len(fired) == self._unit_size[unit]:
                self._release_unit(unit)

    # ------------------------------------------------------------------ step
    def reduce_gradients(self) -> None:
        self._flush_deferred()
        if not self._reduced:
            self._release_all()  # backward is over; units left gathered had unused parameters
        super().reduce_gradients()

    def _publish_shards(self) -> None:
        self._release_all()
        works = []
        for b in self.buckets:
            if b.persistent:
                works.append(self._gather_bucket(b))
            elif b.compute_shard is not b.shard_master:
                assert b.compute_shard is not None  # set for every ZeRO-3 bucket (_init_bucket)
                # gathered again on the next use; offload: the host update (or its low-precision
                # copy) crosses to the device here, or stays on the host with offload_param
                b.compute_shard.copy_(self._updated_shard(b), non_blocking=b.compute_shard.is_cuda)
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._tracing and self._trace:
            self._tracing = False  # the first step's fetch order is recorded
            self._index_trace()
        self._trace_pos = 0
        self._last_use.clear()

    # ------------------------------------------------------------------ GatheredParameters
    def _buckets_of(self, params: list[torch.Tensor]) -> list[FlatBucket]:
        found = {self._where[id(p)][0].index for p in params if id(p) in self._where}
        return [b for b in self.buckets if b.index in found and not b.persistent]

    def gather_for_modification(self, params: list[torch.Tensor]) -> None:
        """Make ``params`` whole (every rank; :class:`engine.zero.GatheredParameters`)."""
        for b in self._buckets_of(params):
            self._materialize(b)

    def release_after_modification(self, params: list[torch.Tensor], modifier_rank: Optional[int]) -> None:
        """Partition ``params`` again; with ``modifier_rank`` (a rank of each bucket's reduce
        group: the data-parallel group for dense parameters) its values are broadcast and
        written to every rank's compute shard and fp32 master shard."""
        for b in self._buckets_of(params):
            if modifier_rank is not None and not 0 <= modifier_rank < b.reduce_group.size:
                raise ValueError(f"modifier_rank {modifier_rank} is not a rank of the data-parallel group of "
                                 f"{b.reduce_group.size}")
            # gather_for_modification bound b.full; every ZeRO-3 bucket has a compute shard
            assert b.full is not None and b.compute_shard is not None
            if modifier_rank is not None:
                src = b.reduce_group.global_rank_of(modifier_rank)
                comm.broadcast(b.full, src, b.reduce_group)
                shard = b.shard_of(b.full)
                b.compute_shard.copy_(shard)
                if b.compute_shard is not b.shard_master:
                    b.shard_master.copy_(shard)
            self._release_bucket(b, keep_aliases=True)

    def gather_groups(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``params`` (in order) grouped by the bucket one gather makes whole: a
        :class:`engine.zero.GatheredParameters` over one group holds at most one unit
        gathered. Parameters this optimizer never gathers (persistent, not its own) are
        groups of one."""
        out: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            where = self._where.get(id(p))
            key = ("bucket", where[0].index) if where is not None and not where[0].persistent else ("one", id(p))
            out.setdefault(key, []).append(p)
        return list(out.values())

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """All parameters whole inside the block (read-only: changes are not written back)."""
        for unit in self._units:
            for b in self._units[unit]:
                self._materialize(b)
        try:
            yield
        finally:
            self._release_all()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release every gathered unit (those kept for reuse after a forward
        without backward, e.g. an evaluation); the next use gathers again. Between steps only:
        inside a forward or backward the units in use would be released under it."""
        self._release_all()

    def _param_tensors(self) -> list[Optional[torch.Tensor]]:
        return ([b.full for b in self.buckets] + [b.gather_buf for b in self.buckets]
                + [b.compute_shard for b in self.buckets])
