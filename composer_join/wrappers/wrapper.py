"""What differs between the ways Composer wraps a model for data parallelism, behind one small interface.

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

:class:`~composer_join.UnevenJoin` picks one with :func:`~composer_join.wrappers.wrapper_for` once,
at the first ``FIT_START`` (or ``EVAL_START``), and calls it from its events, on every rank, in
this order::

    wrapper.load_state_dict(saved)          # once chosen: what a checkpoint held ({} if none)
    wrapper.state_dict()                    # whenever Composer saves a checkpoint
    wrapper.fit_start(state, plan)          # FIT_START (again at every fit: must be idempotent)
    wrapper.install(changes, state, plan)   # each iteration over the train dataloader opens (an epoch)
    wrapper.eval_start(state, plan)         # EVAL_START (and PREDICT_START)
    wrapper.install_eval(changes, state, plan)  # each iteration over an eval (or predict) dataloader opens
    wrapper.start_step(plan)                # BEFORE_TRAIN_BATCH
    wrapper.before_forward(state, plan, samples, shadow)   # BEFORE_FORWARD, every training microbatch
    wrapper.after_forward(state, plan)      # AFTER_FORWARD
    wrapper.after_loss(state, plan)         # AFTER_LOSS, before the backward pass
    wrapper.after_backward(state, plan, shadow)            # AFTER_BACKWARD
    wrapper.before_checkpoint(state)        # a *_CHECKPOINT event at which a CheckpointSaver saves
    wrapper.fit_end(state)                  # FIT_END

Every change a wrapper makes to an object UnevenJoin does not own (the model's hooks, a ``DataSpec``'s
``split_batch``, a stand-in forward or loss) goes through the iteration's register of changes given to
:meth:`Wrapper.install` (:mod:`composer_join.core.changes`), undone when the iteration ends, normally or
because the run raised.
``shadow`` is True for a shadow microbatch (a joined rank's, or an empty padding one, weighted zero).
``before_forward`` returns True if it made the shadow microbatch inert itself; otherwise UnevenJoin
swaps in the two-sample template.
The base class is the wrapper for a model that is not wrapped (nothing to do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from composer.core import State

from composer_join.core.changes import Changes
from composer_join.core.plan import StepPlan

__all__ = ['Wrapper']


class Wrapper:
    """No wrapper around the model (a single process): every hook does nothing."""

    def state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint (plain data, the same on every rank); part of UnevenJoin's state_dict."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called once the wrapper is chosen, with what :meth:`state_dict` saved (``{}`` without a checkpoint)."""

    def shadow_way_name(self, state: State) -> str:
        """How this rank's shadow microbatches of a fit will run (one of
        :data:`composer_join.core.settings.SHADOW_WAYS`); asked before :meth:`fit_start`, for the first agreement
        (the collectives a shadow microbatch issues follow from it: it must be the same on every rank)."""
        return 'none'

    def fit_start(self, state: State, plan: Callable[[], Optional[StepPlan]]) -> None:
        """``plan()`` gives the current step's plan whenever a training step or an evaluation batch runs."""

    def install(self, changes: Changes, state: State, plan: Callable[[], Optional[StepPlan]]) -> None:
        """An iteration over the train dataloader opens: make this wrapper's changes through ``changes``."""

    def eval_start(self, state: State, plan: Callable[[], Optional[StepPlan]]) -> None:
        """As :meth:`fit_start`, for an evaluation (which may run without any fit)."""

    def install_eval(self, changes: Changes, state: State, plan: Callable[[], Optional[StepPlan]]) -> None:
        """An iteration over an eval (or predict) dataloader opens: as :meth:`install`."""

    def start_step(self, plan: StepPlan) -> None:
        pass

    def before_forward(self, state: State, plan: StepPlan, samples: int, shadow: bool) -> bool:
        return False

    def after_forward(self, state: State, plan: StepPlan) -> None:
        pass

    def after_loss(self, state: State, plan: StepPlan) -> None:
        pass

    def after_backward(self, state: State, plan: StepPlan, shadow: bool) -> None:
        pass

    def before_checkpoint(self, state: State) -> None:
        """Before a checkpoint is saved: make what it holds the same on every rank."""

    def fit_end(self, state: State) -> None:
        pass
