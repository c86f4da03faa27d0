"""What differs between the ways Composer wraps a model for data parallelism, behind one small contract.

A joined rank runs the same training step as every other rank; what it must take care of beyond
that depends on the wrapper around the model:

* where buffers live: under DDP, on a source rank that broadcasts them before every synced
  forward (:mod:`composer_join.wrappers.ddp` moves the source off an exhausted rank); under FSDP1/FSDP2,
  on every rank, each its own (:mod:`composer_join.wrappers.fsdp`);
* how a shadow microbatch runs: under DDP normally no model code at all, only DDP's collectives
  (:mod:`composer_join.shadow.shadow`); where a forward must run (FSDP, SyncBatchNorm), its buffers are
  snapshot (after DDP's broadcast) and restored after the backward pass, by a
  :class:`~composer_join.shadow.buffers.BufferGuard` on the module each wrapper runs;
* uneven microbatch counts: DDP syncs only each rank's last microbatch
  (:class:`~composer_join.wrappers.ddp.MicrobatchSync`); FSDP, which all-gathers and reduce-scatters on
  every microbatch, pads every rank to the step's largest count with shadow microbatches
  (:class:`~composer_join.shadow.padding.MicrobatchPadding`);
* parameters some rank's microbatch does not use: DDP's ``find_unused_parameters`` and
  ``forced_sync`` handle them; FSDP checks them per microbatch and stops every rank with
  :class:`~composer_join.UnevenInputsError` where it would hang
  (:class:`~composer_join.wrappers.fsdp.GradientUnits`).

The contract. :class:`~composer_join.UnevenJoin`'s run picks one wrapper with
:func:`~composer_join.wrappers.wrapper_for` once, at the trainer's first active start event, and its sessions
(:mod:`composer_join.join.fit`, :mod:`composer_join.join.evaluation`) call it on every rank, in this order::

    wrapper.load_state_dict(saved)              # once chosen: what a checkpoint held ({} if none)
    wrapper.facts(state)                        # FIT_START, for the first agreement (shadow way, what fits taught it)
    wrapper.start(state, train)                 # FIT_START (train), EVAL_START, PREDICT_START: idempotent
    wrapper.agreed(state, facts)                # FIT_START, after start: every rank's facts from the first agreement
    wrapper.install(changes, state, plan, train, spec)  # each iteration over a dataloader opens, with its register
    wrapper.watches(state, plan)                # BEFORE_TRAIN_BATCH of a step where no rank shadows: needed?
    wrapper.begin_step(state, plan)             # BEFORE_TRAIN_BATCH of a step UnevenJoin runs in
    with wrapper.microbatch(state, plan, shadow, samples) as mb:  # BEFORE_FORWARD of each of its microbatches
        mb.after_forward(state); mb.after_loss(state); mb.after_backward(state)
    wrapper.equalize(state)                     # before a checkpoint is saved, and at FIT_END
    wrapper.state_dict()                        # whenever Composer saves a checkpoint

``plan`` is the step's :class:`~composer_join.core.plan.StepPlan`, a value, except in :meth:`Wrapper.install`,
where it is ``() ->`` the plan of the step running then (a ``DataSpec``'s ``split_batch`` is called outside any
event). On a step where no rank shadows, UnevenJoin calls nothing per microbatch unless :meth:`Wrapper.watches`
says a setting every rank shares needs it (automatic microbatching's OOM checks, ``multi_auto_sync`` on uneven or
unknown microbatch counts, FSDP's per-microbatch check); Composer's event loop then costs the step nothing more.

Every change a wrapper makes to an object UnevenJoin does not own goes through a register of changes
(:mod:`composer_join.core.changes`): the model's hooks and a ``DataSpec``'s ``split_batch`` through the iteration's
register given to :meth:`Wrapper.install`, undone when the iteration ends, normally or because the run raised; a
microbatch's stand-ins (a forward, a loss) through its :class:`Microbatch`'s own, undone when it exits: after its
backward pass, or when the step or the iteration ends first (a retried step, a raise). The base class is the
wrapper for a model that is not wrapped (nothing to do).

Example (what a session does for one microbatch of a step it runs in)::

    mb = wrapper.microbatch(state, plan, shadow=True, samples=0)
    fed = not mb.inert  # the template's two samples go to the forward unless the wrapper made it inert
    with mb:  # BEFORE_FORWARD ... AFTER_BACKWARD (entered and exited across Composer's events)
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from composer.core import DataSpec, State

from composer_join.core.changes import Changes
from composer_join.core.plan import StepPlan
from composer_join.core.settings import SHADOW_WAYS, Facts

__all__ = ['Microbatch', 'Wrapper']


class Microbatch:
    """One microbatch of a step UnevenJoin runs in, as a wrapper sees it: a context, entered at ``BEFORE_FORWARD``.

    Made by :meth:`Wrapper.microbatch` (its constructor decides, with no side effect, how a shadow microbatch
    runs: :attr:`inert`); :meth:`__enter__` makes its changes, stand-ins through :attr:`stand_ins`; the session
    calls :meth:`after_forward`, :meth:`after_loss`, :meth:`after_backward` at those events, and :meth:`__exit__`
    after the backward, or when the step or its iteration ends first: it undoes the stand-ins. The base class does
    nothing but that.
    """

    inert = False
    """A shadow microbatch that needs no template input: the wrapper stands in for the forward (or it runs on the
    zero-sample batch itself)."""

    def __init__(self) -> None:
        self.stand_ins = Changes()  # this microbatch's stand-ins (a forward, a loss), undone at its exit

    def __enter__(self) -> Microbatch:
        return self

    def after_forward(self, state: State) -> None:
        """``AFTER_FORWARD``."""

    def after_loss(self, state: State) -> None:
        """``AFTER_LOSS``, before the backward pass."""

    def after_backward(self, state: State) -> None:
        """``AFTER_BACKWARD``; the exit follows."""

    def __exit__(self, *exc: Any) -> None:
        self.stand_ins.undo()


class Wrapper:
    """No wrapper around the model (a single process): nothing to do (see the module docstring for the contract)."""

    def state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint (plain data, the same on every rank); part of UnevenJoin's state_dict."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called once the wrapper is chosen, with what :meth:`state_dict` saved (``{}`` without a checkpoint)."""

    def facts(self, state: State) -> dict[str, Any]:
        """This rank's :class:`~composer_join.core.settings.Facts` fields of the model, for a fit's first agreement,
        asked at ``FIT_START`` before :meth:`start`: how its shadow microbatches will run (``shadow``, an index of
        :data:`~composer_join.core.settings.SHADOW_WAYS`: the collectives a shadow microbatch issues follow from it),
        and what it learned of the model in the trainer's earlier fits that decides a shadow microbatch's collectives
        or take-backs (``forward``, ``fresh``). Default: not wrapped (``'none'``)."""
        return {'shadow': SHADOW_WAYS.index('none')}

    def agreed(self, state: State, facts: Sequence[Facts]) -> None:
        """``FIT_START``, after :meth:`start`: every rank's facts from the fit's first agreement, to decide from
        alike on every rank."""

    def start(self, state: State, train: bool) -> None:
        """``FIT_START`` (``train``), ``EVAL_START`` or ``PREDICT_START``: attach to the model as Composer wrapped
        it (again at every start: idempotent)."""

    def install(
        self,
        changes: Changes,
        state: State,
        plan: Callable[[], Optional[StepPlan]],
        train: bool,
        spec: Optional[DataSpec] = None,
    ) -> None:
        """An iteration over the train (``train``) or an eval or predict dataloader opens: make this wrapper's changes
        through ``changes``, its register; ``plan()`` gives the plan of the step running at any time. ``spec``: the
        ``DataSpec`` Composer splits the dataloader's batches with, found once by the session: in training the
        Trainer's train ``DataSpec`` (None where it was not found), in an evaluation that of the evaluator holding the
        dataloader Composer iterates (:func:`~composer_join.shadow.dataspec.evaluator_for`); None in ``predict()``."""

    def watches(self, state: State, plan: StepPlan) -> bool:
        """Whether a training step where no rank shadows still needs :meth:`begin_step` and :meth:`microbatch`,
        because of a setting every rank has alike (the same answer on every rank). Asked at ``BEFORE_TRAIN_BATCH``."""
        return False

    def begin_step(self, state: State, plan: StepPlan) -> None:
        """``BEFORE_TRAIN_BATCH`` of a step UnevenJoin runs in (again at each attempt Composer retries)."""

    def microbatch(self, state: State, plan: StepPlan, shadow: bool, samples: int) -> Microbatch:
        """The next training microbatch of the step, not entered yet: ``shadow``, a stand-in (weighted zero);
        ``samples``, its samples as Composer counts them (0 if none or uncountable)."""
        return Microbatch()

    def equalize(self, state: State) -> None:
        """Before a checkpoint is saved, and at ``FIT_END``: make what they hold the same on every rank."""
