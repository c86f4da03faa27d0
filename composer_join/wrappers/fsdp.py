"""The places where UnevenJoin reaches into Composer's FSDP (torch's ``FullyShardedDataParallel`` and ``fully_shard``).

Under FSDP every microbatch all-gathers each FSDP unit's parameters in the forward (and again in
the backward) and reduce-scatters its gradients; Composer has no ``no_sync`` for FSDP. So every
rank must run the same number of microbatches in a step, and each microbatch must give gradients
to the same parameters on every rank. Three pieces see to that:

* :class:`~composer_join.shadow.padding.MicrobatchPadding` (:mod:`composer_join.shadow.padding`): every rank
  splits the step into the same number of microbatches, the step's largest; a rank with fewer
  appends empty ones, shadow microbatches (two template samples, gradient weight zero). A padding
  microbatch costs a two-sample forward and backward with FSDP's usual all-gathers and
  reduce-scatters; no more memory than a real one.
* :class:`GradientUnits`: FSDP has no ``find_unused_parameters``. After each microbatch's loss,
  before its backward pass, the parameters it uses (those its autograd graph reaches, and those a reentrant
  activation-checkpointing segment of its forward ran with) are compared across ranks
  (one sum of one integer per gradient unit over every rank, on the host over gloo: no GPU sync; from 8 ranks
  pairwise, in ``log2 W`` rounds, not gloo's ring); where they differ, every rank raises
  :class:`~composer_join.UnevenInputsError` instead of hanging in the reduce-scatter. A gradient
  unit is an FSDP1 flat parameter (parameters unused inside a used flat parameter get zeros, so
  FSDP1 copes with those) or an FSDP2 parameter.
* a :class:`~composer_join.shadow.buffers.BufferGuard` on the whole model: FSDP does not broadcast
  buffers, every rank keeps its own, so a shadow forward must simply leave this rank's untouched.
* the loss of a shadow microbatch is :func:`~composer_join.shadow.shadow.connected_zero_loss` (zero,
  reaching every output, with the structure of the model's loss), not the model's own, which
  may fail on two samples (top-k mining); the forward still runs, for FSDP's all-gathers.

:class:`FSDPWrapper` puts them behind the :class:`~composer_join.wrappers.wrapper.Wrapper` interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from composer.core import DataSpec, State
from composer.utils import dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from composer_join.core import compat
from composer_join.core.catalogue import FSDP_UNITS
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.plan import StepPlan
from composer_join.interop.oom import OOMChecks
from composer_join.shadow.buffers import BufferGuard
from composer_join.shadow.gradients import reached_leaves
from composer_join.shadow.padding import MicrobatchPadding
from composer_join.shadow.shadow import LossShape, connected_zero_loss
from composer_join.wrappers.wrapper import Microbatch, Wrapper

__all__ = ['FSDPMicrobatch', 'FSDPWrapper', 'GradientUnits']


class GradientUnits:
    """The units FSDP reduces gradients by, and a per-microbatch check that every rank uses the same ones.

    FSDP1: one flat parameter per FSDP instance (its reduce-scatter covers the whole flat
    parameter, zeros where a parameter had no gradient). FSDP2: one per parameter (its
    reduce-scatter covers only parameters with a gradient). Call :meth:`watch` before each microbatch's forward
    and :meth:`check` after its loss, before its backward, on every rank; :meth:`attach` once per iteration.

    The check must know before the backward which units the backward will give a gradient (a reduce-scatter),
    from two facts:

    * the units whose gradient tensor the loss's autograd graph reaches
      (:func:`~composer_join.shadow.gradients.reached_leaves`), per parameter as FSDP2 reduces, also where the use
      depends on the data (a branch only some samples take);
    * the units a **reentrant activation-checkpointing segment** uses (``torch.utils.checkpoint(...,
      use_reentrant=True)``, Composer's ``activation_checkpointing`` with ``activation_checkpointing_reentrant``,
      Hugging Face's ``gradient_checkpointing_enable()``). Such a segment runs its forward with gradients off
      and keeps no graph of it: the loss's graph does not reach its parameters, which the backward recomputes
      and gives a gradient later, in a second backward pass. Torch does tell which modules ran: a forward
      pre-hook on every module that holds a unit's parameters (public ``register_forward_pre_hook``, on the
      iteration's register of changes) records the units of those that ran **with gradients off** while the
      microbatch's forward runs with them on, i.e. inside such a segment. Without this the check read those
      units as unused on every rank: right where every rank runs the segment alike, but where only some ranks'
      data runs it, their reduce-scatters did not match (FSDP2: gloo aborted;
      ``tests/test_activation_checkpointing.py``).

    Where it errs: a segment none of whose inputs requires a gradient gives its parameters none at all (torch
    warns), yet its units read as used here, so if only some ranks run such a segment, every rank stops with the
    error although the backward would have matched. The prediction is not checked again after the backward: had
    it been wrong the other way, the ranks' backward collectives would not have matched, which hangs (NCCL) or
    aborts (gloo) in that backward already, before a check could run; only units of equal size could pass
    silently there, and to see that every backward would need a hook per unit and every microbatch a collective
    more.

    Cost per microbatch: a walk over the loss's autograd graph (about 1 us per node in Python: 0.4 ms for a
    12-layer transformer encoder), one Python call per forward of a module holding a unit's parameters, and one
    sum over every rank of ``units + 1`` int32 (nothing in it per rank: a rank's failure counts in one integer, and
    only where some rank failed do the ranks gather who, on that error path), synchronous: the backward waits for
    it. The sum is :meth:`~composer_join.core.exchange.TorchExchange.host_sum`: gloo's all-reduce under 8 ranks,
    from 8 on recursive doubling over gloo ``isend``/``irecv``, ``ceil(log2 W)`` rounds (two more where W is not a
    power of two) of about 30-50 us of host CPU each (``benchmarks/fsdp_check.py``): gloo's all-reduce is a ring,
    ``2 (W - 1)`` hops in a row, about 50 ms at 1,024 ranks and 200 ms at 4,096 at 25 us a hop, the pairwise sum
    about 0.55 and 0.66 ms (docs/benchmarks.md, "At scale").

    Why a collective on every microbatch still: which units a rank's backward reduce-scatters is known only after
    its forward on its own data (a branch some samples take, a reentrant segment some ranks' data runs), so no
    rank can know another's before that microbatch's backward without hearing from it, and a mismatch is a hang
    under NCCL. No fact agreed earlier settles it: a first microbatch where every rank used every unit says
    nothing of the next one's data, and that a model never skips a unit cannot be told from Python (its forward
    may branch on the data, on Python's ``random``, on a counter). Nor can microbatches share one collective per
    step: Composer runs each microbatch's backward before the next one's forward, so the next one's units are not
    known yet; nor can it ride on a collective the step has anyway: the step agreement runs before the step's
    forwards, FSDP's own all-gathers and reduce-scatters are on the device and the backward's come after the
    decision. What can be made cheaper is the sum's latency, which is what grows with W.
    """

    def __init__(self, model: torch.nn.Module):
        names = {id(p): n for n, p in model.named_parameters()}
        self._fsdp1: list[tuple[str, Any]] = []  # (names, flat parameter)
        self._fsdp2: list[tuple[str, Callable[[], Any]]] = []  # (name, () -> its unsharded parameter)
        unit_modules: list[list[torch.nn.Module]] = []  # per FSDP1 unit, the modules holding its parameters
        fsdp2_index: dict[int, int] = {}  # id of an FSDP2 sharded parameter -> its unit's index among FSDP2's
        for module in model.modules():
            if isinstance(module, FullyShardedDataParallel):
                flat = compat.fsdp1_flat_param(module)
                if flat is not None:
                    self._fsdp1.append(flat)
                    unit_modules.append(compat.fsdp1_modules(flat[1]))
            elif isinstance(module, FSDPModule):
                for sharded, fqn, unsharded in compat.fsdp2_params(module):
                    fsdp2_index[id(sharded)] = len(self._fsdp2)
                    self._fsdp2.append((names.get(id(sharded), fqn), unsharded))
        self._owners: dict[torch.nn.Module, set[int]] = {}  # a module -> the units its own parameters are in
        for unit, modules in enumerate(unit_modules):
            for module in modules:
                self._owners.setdefault(module, set()).add(unit)
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if id(p) in fsdp2_index:
                    self._owners.setdefault(module, set()).add(len(self._fsdp1) + fsdp2_index[id(p)])
        self._watching = False  # the current microbatch's forward runs with gradients on
        self._recomputed: set[int] = set()  # units a reentrant segment of this microbatch used

    def __len__(self) -> int:
        return len(self._fsdp1) + len(self._fsdp2)

    def attach(self, changes: Changes) -> None:
        """The forward pre-hooks that see reentrant segments, until ``changes`` is undone."""
        for module in self._owners:
            changes.hook(module.register_forward_pre_hook(self._ran))

    def watch(self) -> None:
        """Before a microbatch's forward: record the units its reentrant segments use."""
        self._recomputed = set()
        self._watching = torch.is_grad_enabled()

    def _ran(self, module: torch.nn.Module, args: Any) -> None:
        if self._watching and not torch.is_grad_enabled():
            self._recomputed |= self._owners[module]

    def _leaves(self) -> list[Any]:
        """The tensors autograd accumulates gradients into for each unit, right now (after a forward)."""
        leaves = [flat for _, flat in self._fsdp1]
        leaves += [unsharded() for _, unsharded in self._fsdp2]
        return leaves

    def check(
        self,
        loss: Any,
        plan: StepPlan,
        to_device: Callable[[torch.Tensor], torch.Tensor],
        failure: Optional[BaseException] = None,
    ) -> None:
        """Raise :class:`UnevenInputsError` on every rank if this microbatch uses a unit that another rank's does not
        (``loss`` reaches it, or a reentrant segment of its forward used it).

        The used-unit flags are known on the host (from the graph walk) and all-reduced on the host, over
        gloo (:func:`host_group`: the default group under gloo, a gloo group beside NCCL), so the check
        never waits for the GPU: the forward's kernels keep running while the ranks compare flags.
        ``failure``: an error this rank found in this step (its microbatches cannot be padded): it
        travels in the same all-reduce (one more integer: how many ranks failed), and every rank raises (the
        failing ones are named by one ``all_gather_object``, on that error path only).
        """
        reached, self._watching = reached_leaves(loss), False  # the backward's recomputations are not watched
        world = dist.get_world_size()
        uses = [
            (leaf is not None and id(leaf) in reached) or unit in self._recomputed
            for unit, leaf in enumerate(self._leaves())
        ]
        used = torch.tensor([*uses, int(failure is not None)], dtype=torch.int32)
        said = FSDP_UNITS.said(f'the all-reduce of the FSDP units used at step {plan.step}')
        used = TorchExchange(group=host_group()).host_sum(used, said)  # a CPU tensor, over gloo: log2 W rounds at scale
        used, any_failed = used[: len(self)], int(used[len(self)])
        failed: list[int] = []
        if any_failed:  # on every rank alike: name the failing ranks (an error path)
            said = FSDP_UNITS.said(f'the gather of the ranks whose microbatches of step {plan.step} cannot be padded')
            failed = [r for r, f in enumerate(TorchExchange().gather(failure is not None, said)) if f]
        if failure is not None:
            raise failure
        if failed:
            raise UnevenInputsError(
                f'rank(s) {failed} cannot run step {plan.step} under FSDP (their microbatches '
                f"cannot be padded to the others' count); every rank stops here, they raise the cause"
            )
        names = [n for n, _ in self._fsdp1] + [n for n, _ in self._fsdp2]
        partial = [(names[i], int(c)) for i, c in enumerate(used.tolist()) if 0 < c < world]
        if partial:
            which = '; '.join(f'{name} (used on {count} of {world} ranks)' for name, count in partial)
            raise UnevenInputsError(
                f"at step {plan.step}, ranks' microbatches give gradients to different parameters under FSDP: "
                f'{which}. FSDP reduce-scatters a gradient unit (an FSDP2 parameter, an FSDP1 flat parameter) only on '
                f"ranks that used it and has no find_unused_parameters, so the ranks' reduce-scatters would not "
                f'match (a hang, a crash or mixed-up gradients). Every microbatch must use the same '
                f"parameters on every rank (shadow microbatches run two samples of this rank's first batch): make "
                f'the forward use every parameter (e.g. multiply an unused branch by zero instead of skipping it), '
                f'or train this model with DDP, where UnevenJoin supports unused parameters.',
            )


_HOST_GROUP: list = []  # [group] once made (None: the default group is gloo already)


def host_group():
    """A process group for small agreements made on the host: None (the default group) if that is gloo, else a gloo group.

    Made once per process, on first use, which must be on every rank at the same point (a
    collective): ``GradientUnits.check``, called on every rank for every microbatch. Under NCCL a
    CPU tensor all-reduced over gloo costs the host a network round trip but no GPU synchronisation.
    """
    if not _HOST_GROUP:
        default = torch.distributed.get_backend()
        _HOST_GROUP.append(None if default == 'gloo' else torch.distributed.new_group(backend='gloo'))
    return _HOST_GROUP[0]


class FSDPWrapper(Wrapper):
    """UnevenJoin's FSDP1/FSDP2-specific part: microbatch padding, the unused-parameter check, buffer guard.

    Chosen by :func:`~composer_join.wrappers.wrapper_for` when Composer sharded the model with FSDP. Every
    training step needs it at every microbatch (:meth:`watches`): its padding may add shadow microbatches on any
    step, and every microbatch's units are checked on every rank (a collective).
    """

    def __init__(self):
        self.model: Optional[torch.nn.Module] = None
        self.guard: Optional[BufferGuard] = None
        self.units: Optional[GradientUnits] = None
        self.oom = OOMChecks()
        self.failures: list = []  # errors MicrobatchPadding found in this step, raised at its first loss
        self.loss_shape = LossShape()

    def start(self, state: State, train: bool) -> None:
        if state.model is not self.model:
            self.model = state.model
            self.guard = BufferGuard(state.model)
            self.units = GradientUnits(state.model)
            if len(self.units):
                host_group()  # made here, on every rank at once (a collective), not at a first check an OOM may skip

    def install(
        self,
        changes: Changes,
        state: State,
        plan: Callable[[], Optional[StepPlan]],
        train: bool,
        spec: Optional[DataSpec] = None,
    ) -> None:
        """Pad the ``DataSpec``'s microbatches, guard the buffers, until ``changes`` is undone. Train: the trainer's
        ``DataSpec``, with its own sample count, errors raised on every rank at the first loss; an evaluation: the
        evaluator's, errors raised at once."""
        if train:
            if spec is None:
                raise UnevenInputsError(
                    "UnevenJoin under FSDP could not find the Trainer's train DataSpec to pad microbatches; it must "
                    'run inside composer.Trainer.fit()',
                )
            failures = self.failures if len(self.units) else None
            count = spec.get_num_samples_in_batch
            MicrobatchPadding.install(
                spec, changes, plan, state.device.tensor_to_device, checks=self.oom, count=count, failures=failures
            )
        elif spec is not None:  # the evaluator's (predict(): none)
            MicrobatchPadding.install(
                spec, changes, plan, state.device.tensor_to_device, count=spec.get_num_samples_in_batch
            )
        self.guard.attach(changes)
        if train:
            changes.call(self.failures.clear)  # found in a step the run left half-way
            if len(self.units):
                self.units.attach(changes)

    def watches(self, state: State, plan: StepPlan) -> bool:
        return True

    def begin_step(self, state: State, plan: StepPlan) -> None:
        self.oom.start_step()
        if self.guard is not None and self.guard.armed:  # a retry after an OOM in a shadow microbatch
            self.guard.restore()

    def microbatch(self, state: State, plan: StepPlan, shadow: bool, samples: int) -> FSDPMicrobatch:
        return FSDPMicrobatch(self, state, plan, shadow)


class FSDPMicrobatch(Microbatch):
    """One training microbatch under FSDP (:class:`~composer_join.wrappers.wrapper.Microbatch`): the OOM checks, its
    gradient units checked on every rank after its loss; shadowing, a zero loss connected to the outputs (once the
    model's own loss was seen: before, the model's own on the template) and the buffers guarded."""

    def __init__(self, wrapper: FSDPWrapper, state: State, plan: StepPlan, shadow: bool):
        super().__init__()
        self.wrapper, self.state, self.plan, self.shadow = wrapper, state, plan, shadow

    def __enter__(self) -> FSDPMicrobatch:
        w = self.wrapper
        if len(w.units):
            w.units.watch()
        if self.shadow:
            w.guard.armed = True
            if w.loss_shape.known:  # else (no real loss seen yet on this rank) the model's own, on the template
                shape = w.loss_shape
                self.stand_ins.set(self.state.model, 'loss', lambda outputs, batch: connected_zero_loss(shape, outputs))
        return self

    def after_forward(self, state: State) -> None:
        self.wrapper.oom.after_forward(state)

    def after_loss(self, state: State) -> None:
        w = self.wrapper
        w.oom.after_loss(state)  # automatic microbatching: before the unused-parameter check's all-reduce
        failure = w.failures[0] if w.failures else None
        w.failures.clear()
        if len(self.stand_ins):
            self.stand_ins.undo()
        else:
            w.loss_shape.record(state.loss)
        if len(w.units):
            w.units.check(state.loss, self.plan, state.device.tensor_to_device, failure)
        elif failure is not None:
            raise failure

    def after_backward(self, state: State) -> None:
        self.wrapper.oom.after_backward(state)
        if self.shadow:
            self.wrapper.guard.restore()
