"""The places where UnevenJoin reaches into torch's ``DistributedDataParallel``.

* :func:`broadcast_buffers_from`: DDP broadcasts module buffers (BatchNorm statistics) from rank 0
  before each synced forward. Once rank 0 has run out of data its buffers are stale, so, as torch's
  own join does, the broadcast must come from a rank that still has data. This registers a buffer
  hook that runs DDP's own coalesced broadcast, from the rank a callable names. Same collectives,
  same cost, one different source.
* a shadow forward must not fold the stand-in batch into the model's buffers: a
  :class:`~composer_join.shadow.buffers.BufferGuard` on the wrapped module snapshots them after DDP's
  broadcast and restores them after the backward pass.
* :class:`MicrobatchSync`: every rank must issue the same gradient collectives in a step, even
  when ranks split it into different numbers of microbatches.
* :func:`sync_buffers`: buffers equal on every rank where they are read (before each evaluation,
  at the end of ``fit``, before a checkpoint is saved): one broadcast from the buffer source, as
  torch's join broadcasts the model at the end.
* a shadow microbatch runs no model code at all (:class:`~composer_join.shadow.shadow.DDPShadow`): only
  DDP's collectives. Where the forward itself communicates (``SyncBatchNorm``), it runs on the
  zero-sample batch instead, every rank splits the step into the same number of microbatches
  (:class:`~composer_join.shadow.padding.MicrobatchPadding`) and the loss is a zero-weighted sum of the
  outputs (:func:`connected_zero_loss`); the buffers of other modules are guarded.
* :class:`DDPWrapper`: the above behind the :class:`~composer_join.wrappers.wrapper.Wrapper` interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from composer.core import DataSpec, State
from torch.nn.parallel import DistributedDataParallel

from composer_join.core import compat
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.plan import StepPlan
from composer_join.core.settings import SHADOW_WAYS, Facts
from composer_join.interop.oom import OOMChecks
from composer_join.shadow.buffers import BufferGuard
from composer_join.shadow.gradients import UnusedParameters, no_sparse_rows, share_grad_presence
from composer_join.shadow.padding import MicrobatchPadding
from composer_join.shadow.shadow import (
    DDPShadow,
    ForwardProbe,
    LossShape,
    connected_zero_loss,
    forward_communicates,
    skippable,
)
from composer_join.shadow.zero_samples import ZeroSampleCheck
from composer_join.wrappers import static_graph
from composer_join.wrappers.wrapper import Microbatch, Wrapper

__all__ = [
    'BufferSource',
    'DDPMicrobatch',
    'DDPWrapper',
    'FreshRanks',
    'MicrobatchSync',
    'NoModelCode',
    'ShadowWay',
    'ZeroSamples',
    'broadcast_buffers_from',
    'shadow_way',
    'sync_buffers',
    'way_name',
]


def broadcast_buffers_from(ddp: DistributedDataParallel, source_rank: Callable[[], int]) -> None:
    """Make ``ddp`` broadcast its buffers from ``source_rank()`` instead of rank 0, before each synced forward."""

    def hook(_state, named_buffers: dict[str, torch.Tensor]) -> None:
        compat.broadcast_ddp_buffers(ddp, source_rank(), list(named_buffers.values()))

    compat.register_buffer_hook(ddp, hook)


def sync_buffers(ddp: DistributedDataParallel, source: int) -> None:
    """Broadcast ``ddp``'s buffers from rank ``source`` (all ranks call it), if DDP broadcasts buffers at all."""
    if not ddp.broadcast_buffers:
        return
    compat.assign_ddp_buffers(ddp)  # buffers the forward replaced (self.count = self.count + 1)
    if len(ddp.modules_buffers) > 0:
        with torch.no_grad():
            compat.broadcast_ddp_buffers(ddp, source)


class BufferSource:
    """The rank whose buffers DDP broadcasts: rank 0 (as stock DDP) until it runs out of data, then a rank with data.

    Unlike torch's join, which takes the highest rank with data at every step, the source only
    moves when it must: a rank that shadowed the end of the last epoch missed that epoch's final
    buffer updates, so making it the source when the next epoch starts would drop them. Call
    :meth:`update` once per step, with the step's plan, on every rank.
    """

    def __init__(self):
        self.rank = 0

    def update(self, plan: StepPlan) -> None:
        if not plan.has_batch(self.rank) and plan.active_ranks:
            self.rank = plan.active_ranks[-1]


class MicrobatchSync:
    """Makes every rank issue the same gradient collectives in a step, whatever its microbatch count.

    * ``multi_auto_sync`` syncs every microbatch. On a step whose ranks have different microbatch
      counts, or where the others' counts are not known (a step planned from the lengths, see
      :func:`~composer_join.core.plan.plan_from_lengths`: batch sizes may vary on any step, e.g. with
      token-budget batching), only each rank's last microbatch syncs: DDP all-reduces the
      gradient accumulated over all of them, so the sum is the same, in one sync per rank.
    * ``forced_sync`` all-reduces ``p.grad`` by hand after the last microbatch, skipping ``None``
      gradients; on steps with a joined rank, or with ``find_unused_parameters``, a zero gradient
      is given where another rank has one (:func:`share_grad_presence`, one small collective).
    * ``single_auto_sync`` already syncs once per rank per step: nothing to do.

    A rank's last microbatch is the one that completes its batch's sample count. Call
    :meth:`start_step` once per step, :meth:`before_forward` and :meth:`after_backward` around
    every microbatch, on every rank, on the steps where :meth:`needed`. A sync turned off goes through the
    microbatch's register of stand-ins, so it is on again when the microbatch exits (after its backward, or
    when a retried or raised step ends it). Cost: one sample count per microbatch.
    """

    def __init__(self, padded: Optional[Callable[[], int]] = None):
        self.seen = 0  # samples of this step's microbatches so far
        self.index = 0  # microbatches of this step so far
        self.manual = False  # this is the last microbatch and Composer syncs by hand after it
        self.last = False  # this is this rank's last microbatch of the step (its samples counted)
        self.padded = padded  # every rank runs this many microbatches (padding): Composer's own syncs match
        self.follow = False  # this step follows Composer's strategy exactly (DDP's first static-graph iteration)

    @staticmethod
    def needed(strategy: Optional[str], ddp: DistributedDataParallel, plan: StepPlan) -> bool:
        """Whether a step where no rank shadows needs it, under Composer's ``ddp_sync_strategy`` (None: unknown):
        ``multi_auto_sync`` where the microbatch counts are uneven or unknown, ``forced_sync`` with
        ``find_unused_parameters`` (DDP's); every step where the strategy is unknown."""
        if strategy is None:
            return True
        if strategy == 'multi_auto_sync':
            return not plan.even_microbatches
        return strategy == 'forced_sync' and ddp.find_unused_parameters

    def start_step(self, follow: bool = False) -> None:
        """A new step; ``follow``: every rank splits it alike and sync must stay as Composer's strategy has it
        (:func:`~composer_join.wrappers.static_graph.first_iteration_syncs`)."""
        self.seen = 0
        self.index = 0
        self.manual = self.last = False
        self.follow = follow

    def before_forward(
        self, ddp: DistributedDataParallel, plan: StepPlan, rank: int, samples: int, stand_ins: Changes
    ) -> None:
        """Before the forward of a microbatch of ``samples`` samples (inside Composer's sync context)."""
        mine = plan.statuses[rank].samples
        self.seen += samples
        self.index += 1
        if self.padded is not None:
            self.last = self.index == self.padded()
            self.manual = self.last and not ddp.require_backward_grad_sync
            return
        final = self.last = 0 <= mine <= self.seen
        if ddp.require_backward_grad_sync and not final and not plan.even_microbatches and not self.follow:
            stand_ins.set(ddp, 'require_backward_grad_sync', False)  # on again when the microbatch exits
        self.manual = final and not ddp.require_backward_grad_sync

    def after_backward(
        self,
        ddp: DistributedDataParallel,
        plan: StepPlan,
        optimizers: Sequence[torch.optim.Optimizer],
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """After the backward of the same microbatch."""
        if self.manual and (ddp.find_unused_parameters or plan.joined_ranks):
            share_grad_presence(optimizers, to_device)
        self.manual = False


def disarm_after_retry(ddp: DistributedDataParallel) -> None:
    """Reset ``ddp``'s reducer when Composer retries a step (automatic microbatching, after a CUDA OOM).

    A microbatch whose forward ran with gradient sync on and whose backward never ran (Composer's
    OOM check stopped it) leaves the reducer expecting a backward: the next backward, even one
    meant not to sync, would all-reduce its gradients on this rank only. Every rank retries the
    step, so every rank resets (torch's own ``Reducer._reset_state``, which ``DistributedDataParallel``
    uses when its process group changes; its buckets are then rebuilt once, on every rank alike).

    The rebuild lays the buckets out in rank 0's order of that step, which differs from the first
    rebuild's when rank 0 shadows in one of them and not in the other (a shadow rank gives every
    parameter at once, in index order; a real one in the order its gradients came). The reducer keeps
    the bucket-to-parameter map of its first rebuild (``get_variables_for_bucket``'s cache, never
    cleared), so ``GradBucket.parameters()`` can then name the parameters in the old order, and
    :class:`~composer_join.shadow.shadow.DDPShadow`, which writes the reduced buckets through it, would
    write them to the wrong parameters. After a reset, shadow microbatches therefore run on the template
    (the reducer's own backward, which needs no map): :meth:`DDPWrapper.begin_step`.
    """
    compat.reset_reducer(ddp)


class ShadowWay:
    """How a shadow microbatch runs under DDP: the interface of the three ways, and the one that runs the model's
    forward and loss on two template samples (any DDP configuration: gradient weight zero, buffers guarded).

    :class:`DDPWrapper` picks one per DDP object (:func:`shadow_way`); each shadow microbatch runs the way
    :meth:`current` gives then: it is :attr:`inert` (needs no template input) or not, :meth:`begin` puts its
    stand-ins in place (``BEFORE_FORWARD``) through the microbatch's register, undone when the microbatch exits,
    and :attr:`model_loss` says whether the loss Composer computes then is the model's own (recorded for the
    stand-ins' loss structure).
    """

    name = 'template'
    inert = False  # it needs no template input
    model_loss = True  # the loss of its microbatch is the model's own (on the template)
    guarded = True  # its forward runs: the buffers are guarded and restored after the backward
    pads = False  # every rank runs the step's largest microbatch count
    probes = False  # a forward that communicates must be found (no forward runs: it would not be matched)
    runs_model = True  # its shadow microbatches run the model (their zero-weighted loss reaches parameters)

    def __init__(self, loss_shape: Optional[LossShape] = None, sparse: Sequence[torch.Tensor] = ()):
        self.loss_shape = loss_shape or LossShape()  # the structure of the model's loss, for stand-in losses
        self.sparse = list(sparse)  # parameters with sparse gradients: a shadow microbatch gives them no row

    def current(self) -> ShadowWay:
        """The way the next shadow microbatch runs (this one, unless it cannot yet)."""
        return self

    def begin(self, state: State, stand_ins: Changes) -> None:
        """``BEFORE_FORWARD`` of a shadow microbatch: its stand-ins, through ``stand_ins``; a model with sparse
        gradients gets an empty one from it (:func:`~composer_join.shadow.gradients.no_sparse_rows`)."""
        if self.sparse:
            no_sparse_rows(self.sparse, stand_ins)

    def after_retry(self) -> ShadowWay:
        """The way to use after a step Composer retried (automatic microbatching)."""
        return self


class ZeroSamples(ShadowWay):
    """Where the forward communicates (:func:`~composer_join.shadow.shadow.forward_communicates`: SyncBatchNorm):
    the model's forward on the zero-sample batch, a zero loss connected to its outputs, microbatch counts padded
    to the step's largest, buffers guarded (SyncBatchNorm's own, global statistics, excepted)."""

    name = 'zero'
    inert = True  # the forward runs on the zero-sample batch itself
    model_loss = False
    pads = True

    def begin(self, state: State, stand_ins: Changes) -> None:
        super().begin(state, stand_ins)
        stand_ins.set(state.model.module, 'loss', lambda outputs, batch: connected_zero_loss(self.loss_shape, outputs))


class NoModelCode(ShadowWay):
    """The default (:func:`~composer_join.shadow.shadow.skippable`): no model code at all, only DDP's collectives
    (:class:`~composer_join.shadow.shadow.DDPShadow`). Its stand-in loss copies the structure of the model's loss,
    so a rank that has not computed one yet (it had no data of its own) runs its first shadow microbatches the
    template way, :class:`ShadowWay`'s (:meth:`current`)."""

    name = 'skip'
    inert = True
    model_loss = False
    guarded = False
    probes = True
    runs_model = False  # but on a rank with no loss of its own yet: the template (a step with needs_template)

    def __init__(self, stand_in: DDPShadow):
        super().__init__(stand_in.loss_shape)
        self.stand_in = stand_in

    def current(self) -> ShadowWay:
        return self if self.loss_shape.known else ShadowWay(self.loss_shape)

    def begin(self, state: State, stand_ins: Changes) -> None:
        self.stand_in.install(stand_ins)

    def after_retry(self) -> ShadowWay:
        """The template way: the reducer's bucket-to-parameter map may be stale now (:func:`disarm_after_retry`)."""
        return ShadowWay(self.loss_shape)


def way_name(ddp: DistributedDataParallel) -> str:
    """The name of the :class:`ShadowWay` :func:`shadow_way` picks for ``ddp`` (no side effect)."""
    if skippable(ddp) is None:
        return NoModelCode.name
    return ZeroSamples.name if forward_communicates(ddp.module) else ShadowWay.name


def shadow_way(ddp: DistributedDataParallel) -> ShadowWay:
    """The way shadow microbatches of ``ddp`` run, decided once per DDP object (see :class:`DDPWrapper`)."""
    name = way_name(ddp)
    if name == NoModelCode.name:
        return NoModelCode(DDPShadow(ddp, ddp.module, ddp.device))
    sparse = compat.sparse_grad_params(ddp)
    return ZeroSamples(sparse=sparse) if name == ZeroSamples.name else ShadowWay(sparse=sparse)


class FreshRanks:
    """The ranks that had seen no loss of the model when a fit started (every rank's
    :class:`~composer_join.core.settings.Facts` ``fresh``): if one shadows at the fit's first step, its shadow
    microbatch runs the model on the template (:meth:`NoModelCode.current`: its stand-in loss has no structure yet),
    whose zero-weighted loss may reach a parameter no real sample of the step used. Every rank knows it from the
    agreed facts, so every rank takes such gradients back on that step (:meth:`DDPWrapper.unused_needed`). After the
    fit's first step every rank has seen a loss (every rank runs a microbatch at every step, real or on the
    template). No communication.
    """

    def __init__(self):
        self.ranks: frozenset[int] = frozenset()
        self.step = -1  # timestamp.batch of the fit's first step
        self.now = False  # the step begun: a fresh rank shadows in it

    def agree(self, facts: Sequence[Facts], step: int) -> None:
        """Every rank's facts from the fit's first agreement; ``step``: the fit's first ``timestamp.batch``."""
        self.ranks = frozenset(r for r, f in enumerate(facts) if f.fresh)
        self.step = step

    def start_step(self, plan: StepPlan, step: int) -> None:
        self.now = step == self.step and any(r in self.ranks for r in plan.joined_ranks)


class DDPWrapper(Wrapper):
    """UnevenJoin's DDP-specific part: buffer source and syncs, inert shadow microbatches, per-microbatch gradient sync.

    Chosen by :func:`~composer_join.wrappers.wrapper_for` when ``state.model`` is a
    ``DistributedDataParallel``. Hooks are installed once per DDP object, at its first ``FIT_START``.
    Its changes to the model (buffer and probe hooks, microbatch padding on the train ``DataSpec``) are made
    by :meth:`install` at every iteration over the train dataloader and undone with it.
    A shadow microbatch runs one of three ways (:class:`ShadowWay`), decided once per DDP object: no model code
    (:class:`NoModelCode`, the default), the forward on zero samples where it communicates (:class:`ZeroSamples`),
    or the forward and loss on two template samples (:class:`ShadowWay`, for DDP configurations the stand-in
    does not cover). After a step Composer retried (automatic microbatching), the template way.
    A step where no rank shadows needs it at every microbatch only under automatic microbatching (its OOM checks),
    where shadow microbatches run on zero samples (their padding), where the microbatch syncs need it
    (:meth:`MicrobatchSync.needed`: Composer's ``ddp_sync_strategy``), and until the model's loss was seen once.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.source = BufferSource()
        self.sync = MicrobatchSync()
        self.guard: Optional[BufferGuard] = None
        self.hooked: Optional[DistributedDataParallel] = None
        self.oom = OOMChecks()
        self.last_step: Optional[int] = None  # timestamp.batch of the last step begun
        self.way: ShadowWay = ShadowWay()
        self.padding: Optional[MicrobatchPadding] = None
        self.probe: Optional[ForwardProbe] = None
        self.unused = UnusedParameters([])  # on steps with a shadowing rank: no gradient where no real sample was
        self.strategy: Optional[str] = None  # Composer's ddp_sync_strategy (None: not known)
        self.zero = ZeroSampleCheck()  # the 'zero' way: whether every rank's model takes zero samples
        self.fresh = FreshRanks()  # ranks whose first shadow microbatch of this fit runs the model (agreed)

    def state_dict(self) -> dict[str, Any]:
        return {'buffer_source': self.source.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.rank = int(state.get('buffer_source', 0))

    def facts(self, state: State) -> dict[str, Any]:
        """The shadow way (:func:`way_name`: the model's, kept once hooked), and what this rank learned of the model in
        earlier fits where its shadow microbatches run no model code (the default way): no loss seen yet
        (``fresh``), its forward's collectives (``forward``)."""
        name = self.way.name if state.model is self.hooked else way_name(state.model)
        facts: dict[str, Any] = {'shadow': SHADOW_WAYS.index(name)}
        if name != NoModelCode.name:
            return facts
        if state.model is not self.hooked:
            return {**facts, 'fresh': True}
        return {
            **facts,
            'forward': self.probe.fact() if self.probe is not None else 0,
            'fresh': not self.way.loss_shape.known,
        }

    def agreed(self, state: State, facts: Sequence[Facts]) -> None:
        if self.probe is not None:
            self.probe.agree([f.forward for f in facts])
        self.fresh.agree(facts, int(state.timestamp.batch))

    def start(self, state: State, train: bool) -> None:
        if not train:  # an evaluation reads the buffers: the same on every rank
            if isinstance(state.model, DistributedDataParallel):
                sync_buffers(state.model, self.source.rank)
            return
        ddp = state.model
        if ddp is not self.hooked:  # DDP's buffer hook: on Composer's own wrapper, once (torch cannot unhook it)
            broadcast_buffers_from(ddp, lambda: self.source.rank)
            self.hooked = ddp
            self.way = shadow_way(ddp)
            self.probe = ForwardProbe(ddp.module) if self.way.probes else None
            self.unused = UnusedParameters(list(ddp.module.parameters()))
            keep = self.way.pads  # SyncBatchNorm's statistics are global: a shadow forward on zero samples keeps them
            self.guard = BufferGuard(ddp.module, keep=lambda m: keep and isinstance(m, torch.nn.SyncBatchNorm))
        if self.probe is not None:
            self.probe.arm()
        self.zero.reset()
        self.strategy = compat.ddp_sync_strategy(state)

    def install(
        self,
        changes: Changes,
        state: State,
        plan: Callable[[], Optional[StepPlan]],
        train: bool,
        spec: Optional[DataSpec] = None,
    ) -> None:
        if not train:
            return
        self.guard.attach(changes)
        if self.probe is not None:
            self.probe.attach(changes)
        changes.call(self._forget_step)  # a retried step is one of this iteration's
        if isinstance(self.way, NoModelCode):  # its gradient buckets, kept while this iteration's shadow steps run
            changes.call(self.way.stand_in.release)
        self.unused.attach(changes)  # its hooks on the parameters, on a step that needs them
        if spec is not None:  # the Trainer's train DataSpec
            # Forwards that communicate ('zero'): every rank runs the step's largest microbatch count (the
            # padding FSDP uses). Otherwise only count microbatches, for automatic microbatching's OOM checks.
            pad = self.way.pads
            self.padding = MicrobatchPadding.install(
                spec,
                changes,
                plan,
                state.device.tensor_to_device,
                pad=pad,
                checks=self.oom,
                needed=lambda: pad or state.auto_microbatching,
            )
            self.sync.padded = (lambda: self.padding.last_count) if pad else None

    def _forget_step(self) -> None:
        self.last_step = None

    def equalize(self, state: State) -> None:
        sync_buffers(state.model, self.source.rank)

    def watches(self, state: State, plan: StepPlan) -> bool:
        return (
            state.auto_microbatching
            or self.way.pads
            or not self.way.loss_shape.known
            or MicrobatchSync.needed(self.strategy, self.hooked, plan)
            or static_graph.pending(self.hooked)
        )

    def begin_step(self, state: State, plan: StepPlan) -> None:
        step = int(state.timestamp.batch)
        if step == self.last_step and state.auto_microbatching:  # Composer retries this step
            disarm_after_retry(state.model)
            self.way = self.way.after_retry()
            if self.probe is not None:
                self.probe.retried()
        self.last_step = step
        follow = static_graph.pending(state.model) and static_graph.first_iteration_syncs(
            plan, self.rank, self.strategy, TorchExchange(state.device.tensor_to_device)
        )
        self.sync.start_step(follow)
        self.fresh.start_step(plan, step)
        self.unused.start_step()
        self.oom.start_step()
        if self.guard is not None and self.guard.armed:  # a retry after an OOM in a shadow microbatch
            self.guard.restore()
        self.source.update(plan)

    def microbatch(self, state: State, plan: StepPlan, shadow: bool, samples: int) -> DDPMicrobatch:
        return DDPMicrobatch(self, state, plan, samples, self.way.current() if shadow else None)

    def communicating_forward(self, plan: StepPlan) -> UnevenInputsError:
        """The error for a shadow step of a model whose forward issues collectives no marked module explains."""
        kinds = ', '.join(self.probe.communicates)
        return UnevenInputsError(
            f"at step {plan.step} rank(s) {plan.joined_ranks} must shadow, but the model's forward issues collectives "
            f'({kinds}, seen in a training forward of this fit or of an earlier fit on this trainer). Under DDP a shadow microbatch runs no forward, so '
            f'they would not be matched. If the forward all-reduces statistics and accepts a zero-sample input that '
            f'contributes nothing (as torch.nn.SyncBatchNorm does), set shadow_forward = True on that module: shadow '
            f'microbatches then run the forward on zero samples. A forward that exchanges activations shaped like its '
            f'batch cannot be shadowed: give every rank the same number of batches.',
        )

    def unused_needed(self, plan: StepPlan) -> bool:
        """Whether this step takes back gradients no real sample gave (the same on every rank): some rank shadows by
        running the model (this way does, or a rank with no loss of its own yet runs the template: one that never saw a
        batch, in the step's agreed rows, or one that had seen no loss when the fit started, :class:`FreshRanks`)."""
        runs_model = self.way.runs_model or self.fresh.now or plan.template_needed
        return runs_model and UnusedParameters.needed(plan)


class DDPMicrobatch(Microbatch):
    """One training microbatch under DDP (:class:`~composer_join.wrappers.wrapper.Microbatch`): its gradient sync,
    the OOM checks, the unused-parameter record, and, shadowing (``way`` not None), the way's stand-ins and buffers.
    """

    def __init__(self, wrapper: DDPWrapper, state: State, plan: StepPlan, samples: int, way: Optional[ShadowWay]):
        super().__init__()
        self.wrapper, self.state, self.plan, self.samples, self.way = wrapper, state, plan, samples, way
        self.inert = way is not None and way.inert

    def __enter__(self) -> DDPMicrobatch:
        w, plan = self.wrapper, self.plan
        if w.way.pads:  # the forward runs on zero samples where some rank shadows or pads: every rank takes them?
            w.zero.check(self.state.model.module, self.state.batch, TorchExchange(self.state.device.tensor_to_device))
            padded = w.padding is not None and w.padding.uneven
            w.zero.raise_if_needed(plan, bool(plan.joined_ranks) or padded)
        w.sync.before_forward(self.state.model, plan, w.rank, self.samples, self.stand_ins)
        if w.probe is not None and plan.joined_ranks and w.probe.communicates:
            raise w.communicating_forward(plan)
        if self.way is not None:
            self.way.begin(self.state, self.stand_ins)
            w.guard.armed = self.way.guarded
        return self

    def after_forward(self, state: State) -> None:
        self.wrapper.oom.after_forward(state)

    def after_loss(self, state: State) -> None:
        w = self.wrapper
        if self.way is None or self.way.model_loss:  # the model's own (on the template: no data yet)
            w.way.loss_shape.record(state.loss)
        if w.unused_needed(self.plan):  # autograd's hooks record what a real microbatch's backward reaches
            w.unused.record(shadow=self.way is not None)
        w.oom.after_loss(state)

    def after_backward(self, state: State) -> None:
        w = self.wrapper
        w.oom.after_backward(state)  # automatic microbatching: before forced_sync's all-reduces
        w.unused.pause()
        w.sync.after_backward(state.model, self.plan, state.optimizers, state.device.tensor_to_device)
        if w.sync.last and w.unused_needed(self.plan):  # every rank, once per step, after its last backward
            w.unused.finish(state.device.tensor_to_device)

    def __exit__(self, *exc: Any) -> None:
        self.stand_ins.undo()
        if self.way is not None and self.way.guarded:
            self.wrapper.guard.restore()
