"""``UnevenJoin``: the Composer algorithm that lets ranks with less data join instead of stopping everyone.

The class only routes Composer events to the pieces that do the work:

========================  ======================================================================
event                     what happens
========================  ======================================================================
``FIT_START``             agree on the epoch length (longest rank's), wrap the train dataloader
                          in a :class:`~composer_join.loader.JoinLoader` (``mode='rebalance'``:
                          over a :class:`~composer_join.rebalance.RebalancingLoader`), pick the
                          wrapper's part once (:mod:`composer_join.wrapper`: DDP, FSDP1/2 or none)
``EPOCH_START``           reshuffle a ``DistributedSampler`` (Composer skips wrapped loaders)
``BEFORE_TRAIN_BATCH``    wrapper: new step (DDP: microbatch cursor, buffer source)
``BEFORE_FORWARD``        wrapper: this microbatch's sync, guard buffers if shadow; shadow (a joined
                          rank's or an empty padding microbatch): swap in a two-sample template;
                          real: keep a template
``AFTER_LOSS``            weight the gradient: ``0`` for shadow, ``A_t / W`` if asked; wrapper check
``AFTER_BACKWARD``        wrapper: restore syncing and buffers; shadow: keep train metrics out
``AFTER_TRAIN_BATCH``     put train metrics back
``EPOCH_END``             stop every rank if some rank could not form a batch; log the epoch's report
                          (rebalance: with bytes moved)
``EVAL_START``            wrap this evaluator's dataloader the same way (one length agreement);
                          wrapper: FSDP pads eval microbatches
``EVAL_BEFORE_FORWARD``   shadow: swap in the template; real: keep one
``EVAL_AFTER_FORWARD``    shadow: keep the eval metrics out
``EVAL_BATCH_END``        put the eval metrics back
``EVAL_END``              stop every rank if some rank could not form a batch; back to the train plan
========================  ======================================================================
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist

from composer_join.batches import first_samples
from composer_join.gradients import scale_grad
from composer_join.loader import TEMPLATE_SAMPLES, JoinLoader, join_dataloader, pads_by_repeating
from composer_join.plan import StepPlan
from composer_join.rebalance import RebalancingLoader
from composer_join.report import EpochReport
from composer_join.resume import own_sample_counts, restore, snapshot, train_position
from composer_join.wrapper import Wrapper, wrapper_for

__all__ = ['UnevenJoin', 'is_shadow_step']

log = logging.getLogger(__name__)

_STARTS = frozenset((Event.FIT_START, Event.EVAL_START))
_EVENTS = _STARTS | frozenset((
    Event.EPOCH_START, Event.BEFORE_TRAIN_BATCH, Event.BEFORE_FORWARD, Event.AFTER_LOSS, Event.AFTER_BACKWARD,
    Event.AFTER_TRAIN_BATCH, Event.EPOCH_END, Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD,
    Event.EVAL_BATCH_END, Event.EVAL_END,
))  # sets: Composer's Event compares by a Python __eq__, and match() runs for every event


class UnevenJoin(Algorithm):
    """Train data-parallel with a different amount of data on each rank, dropping nothing.

    Every rank trains on every batch of its own shard, every epoch. A rank that runs out *joins*:
    it keeps running Composer's real training step on a shadow batch (two samples whose gradient
    is multiplied by zero, counted as zero samples), so it takes part in every collective of the
    step (DDP's gradient all-reduce or FSDP's all-gathers and reduce-scatters, and all of Composer's
    own) and takes the same optimizer step, until the last rank runs out. Under FSDP, ranks with
    fewer microbatches in a step are padded with shadow microbatches. Then the epoch ends on all
    ranks at the same step. Evaluation works the same way: every rank evaluates every batch of its
    shard, shadow batches stay out of the metrics, so metrics equal those of one process
    evaluating all the data.

    At step ``t``, with ``A_t`` of ``W`` ranks holding real data and ``S_t`` real samples in all,
    the gradient applied is the mean of the per-sample loss gradients over the ``S_t`` samples,
    times ``A_t / W`` if ``divide_by_initial_world_size`` (torch's default) and times 1 otherwise.

    Cost: one collective per fit or evaluation to agree on the epoch length. When every rank's
    dataloader has a ``len()``, no further collective on the steps before the shortest rank's last
    batch, and one small one (``72 * W`` bytes) on each step from there on; without a ``len()`` on
    some rank, that small one on every step. A shadow step costs a two-sample forward and backward.

    Example::

        from composer import Trainer
        from composer_join import UnevenJoin

        trainer = Trainer(
            model=model, train_dataloader=this_ranks_shard, max_duration='2ep',
            algorithms=[UnevenJoin()],
        )
        trainer.fit()
        print(trainer.state.algorithms[0].reports[-1].summary())  # what each rank trained

    Args:
        divide_by_initial_world_size: as in ``DistributedDataParallel.join``: if True (default)
            the gradient is divided by the full world size even when some ranks have joined
            (the mean over real samples times ``A_t / W``); if False, by the number of ranks that
            still have data (the plain mean over real samples).
        enable: if False the algorithm does nothing and Composer behaves as without it.
        throw_on_early_termination: if True, every rank raises :class:`UnevenInputsError` at the
            first training step where some rank has no batch left, before any optimizer step for
            it. (Evaluation always joins: uneven eval shards are evaluated exactly.)
        mode: ``'shadow'`` (default): each rank trains its own batches, ranks that run out shadow.
            ``'rebalance'``: ranks that run out are handed whole batches by ranks that still have
            several, so an epoch lasts ``ceil(total batches / W)`` steps
            (:mod:`composer_join.rebalance`; needs every rank's ``len()``, else it shadows).
            Evaluation always shadows (it is exact).
    """

    MODES = ('shadow', 'rebalance')

    def __init__(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
        mode: str = 'shadow',
    ):
        for name, value in (
            ('divide_by_initial_world_size', divide_by_initial_world_size),
            ('enable', enable),
            ('throw_on_early_termination', throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(f'UnevenJoin({name}=...) must be True or False, got {value!r}')
        if mode not in self.MODES:
            raise ValueError(f"UnevenJoin(mode=...) must be one of {', '.join(map(repr, self.MODES))}; got {mode!r}")
        self.mode = mode
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self.reports: list[EpochReport] = []  # one per finished training epoch, the same on every rank
        self._repr = (
            f'UnevenJoin(divide_by_initial_world_size={divide_by_initial_world_size}, '
            f'enable={enable}, throw_on_early_termination={throw_on_early_termination}'
            + (f', mode={mode!r})' if mode != 'shadow' else ')')
        )  # Composer formats the algorithm into a trace key at every event it runs
        self._rank = 0
        self._active: Optional[bool] = None  # decided at the first FIT_START or EVAL_START
        self._loader: Optional[JoinLoader] = None  # the loader whose plan is current (train or eval)
        self._train_loader: Optional[JoinLoader] = None
        self._eval_loaders: dict[str, JoinLoader] = {}
        self._templates: dict[str, Any] = {}  # per dataloader label: two prepared samples
        self._wrapper: Optional[Wrapper] = None  # DDP's, FSDP's or none: chosen at the first start
        self._shadow = False  # the current microbatch is a stand-in (joined rank, or padding)
        self._stashed_metrics: Optional[tuple[dict, dict]] = None
        self._resumed_report: Optional[EpochReport] = None  # the checkpoint's partial epoch, until FIT_START
        self._wrapper_state: dict[str, Any] = {}  # the checkpoint's wrapper state, until the wrapper exists

    def __repr__(self) -> str:
        return self._repr

    @property
    def plan(self) -> Optional[StepPlan]:
        """The current step's plan, while a training epoch or an evaluation is running."""
        return self._loader.plan if self._loader is not None else None

    @property
    def is_shadow_step(self) -> bool:
        """True while this rank runs a shadow step (it has run out of data, others have not)."""
        plan = self.plan
        return plan is not None and not plan.has_batch(self._rank)

    def state_dict(self) -> dict[str, Any]:
        """Saved in Composer checkpoints: the epoch reports (the current one partial) and the wrapper's state."""
        current = self._train_loader.report if self._train_loader is not None else self._resumed_report
        wrapper = self._wrapper.state_dict() if self._wrapper is not None else self._wrapper_state
        return {**super().state_dict(), **snapshot(self.reports, current, wrapper)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called by Composer when it loads a checkpoint (``load_path``, ``autoresume``), before ``fit``."""
        self.reports, self._resumed_report, self._wrapper_state = restore(state)
        if self._wrapper is not None:
            self._wrapper.load_state_dict(self._wrapper_state)

    def match(self, event: Event, state: State) -> bool:
        return event in _EVENTS and (self._active or (self._active is None and event in _STARTS))

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event in _STARTS and not self._activate():
            return
        if self._wrapper is None:  # chosen once, at the first FIT_START or EVAL_START
            self._wrapper = wrapper_for(state, self._rank)
            self._wrapper.load_state_dict(self._wrapper_state)
        if event == Event.FIT_START:
            self._fit_start(state)
        elif event == Event.EPOCH_START:
            self._train_loader.set_epoch(int(state.timestamp.epoch))
        elif event == Event.BEFORE_TRAIN_BATCH:
            self._wrapper.start_step(self.plan)
        elif event == Event.BEFORE_FORWARD:
            samples = self._microbatch_start(state)
            self._wrapper.before_forward(state, self.plan, samples, self._shadow)
            self._shadow_input(state)
        elif event == Event.AFTER_LOSS:
            factor = 0.0 if self._shadow else self.plan.grad_factor(self.divide_by_initial_world_size)
            if factor != 1.0:
                state.loss = scale_grad(state.loss, factor)
            self._wrapper.after_loss(state, self.plan)
        elif event == Event.AFTER_BACKWARD:
            self._after_backward(state)
        elif event in (Event.AFTER_TRAIN_BATCH, Event.EVAL_BATCH_END):
            self._unstash_metrics()
        elif event == Event.EPOCH_END:
            self._epoch_end(logger)
        elif event == Event.EVAL_START:
            self._eval_start(state)
        elif event == Event.EVAL_BEFORE_FORWARD:
            self._microbatch_start(state)
            self._shadow_input(state)
        elif event == Event.EVAL_AFTER_FORWARD and self._shadow:
            self._stash_metrics(state.eval_metrics[state.dataloader_label])
        elif event == Event.EVAL_END:
            if self._loader is not None:
                self._loader.check_ended_together()
            self._loader = self._train_loader

    # -- starting ----------------------------------------------------------------------------------

    def _activate(self) -> bool:
        if self._active is None:
            why = 'enable=False' if not self.enable else 'world size is 1' if dist.get_world_size() == 1 else None
            self._active = why is None
            self._rank = dist.get_global_rank()
            if why is not None:
                log.info('UnevenJoin is inactive (%s): Composer runs exactly as without it.', why)
            else:
                # Composer's split_batch warns that a shadow batch (zero samples) is smaller than
                # the microbatch size, advice that is meant for a real last batch.
                warnings.filterwarnings('ignore', message='Cannot split tensor of length 0 ')
        return self._active

    def _fit_start(self, state: State) -> None:
        self._train_loader = self._loader = loader = join_dataloader(
            state, self._train_loader, self.throw_on_early_termination, rebalance=self.mode == 'rebalance')
        loader.position = lambda: train_position(state)
        if self._resumed_report is not None:
            loader.report, self._resumed_report = self._resumed_report, None
        # Composer reaches the dataset through state.train_dataloader, the user's own DataLoader.
        own_sample_counts(state._dataset_of(state.train_dataloader), loader.own_samples)
        self._wrapper.fit_start(state, lambda: self.plan)

    def _eval_start(self, state: State) -> None:
        label = state.dataloader_label
        if pads_by_repeating(state.dataloader):
            # torch's DistributedSampler evens shards out by repeating samples, and Composer's eval
            # loop removes exactly those repeats: nothing is uneven, leave it to Composer.
            self._loader = None
            return
        evaluator = next((e for e in state.evaluators if e.label == label), None)
        self._eval_loaders[label] = self._loader = join_dataloader(
            state, self._eval_loaders.get(label),
            microbatch_size=evaluator.device_eval_microbatch_size if evaluator is not None else None,
        )
        self._loader.set_epoch(int(state.timestamp.batch))  # what Composer does for an eval sampler
        self._wrapper.eval_start(state, lambda: self.plan)

    # -- per microbatch ----------------------------------------------------------------------------

    def _microbatch_start(self, state: State) -> int:
        """Whether this microbatch is a stand-in (a joined rank's, or an empty padding one); its samples."""
        samples = self._loader.describe(state.batch)[0] if self._loader is not None else -1
        self._shadow = self.is_shadow_step or samples == 0
        return max(samples, 0)

    def _shadow_input(self, state: State) -> None:
        """Shadow: feed the forward two real samples instead of the empty batch; real: keep two.

        A model may take apart the batch it is given (``HuggingFaceModel.eval_forward`` pops
        ``labels`` and shifts them in place), so no batch object goes to the model twice: the
        template is a copy taken before the forward, and every shadow microbatch gets a fresh copy
        of it (two samples, a few small tensor copies).
        """
        label = state.dataloader_label
        if not self._shadow:
            if label not in self._templates:
                self._templates[label] = first_samples(state.batch, TEMPLATE_SAMPLES)
            return
        if label not in self._templates:  # never had data of its own: the template other ranks sent
            self._templates[label] = state.device.batch_to_device(first_samples(self._loader.template, TEMPLATE_SAMPLES))
        state.batch = first_samples(self._templates[label], TEMPLATE_SAMPLES)

    def _after_backward(self, state: State) -> None:
        self._wrapper.after_backward(state, self.plan, self._shadow)
        if self._shadow and state.train_metrics:
            self._stash_metrics(state.train_metrics)

    def _stash_metrics(self, metrics: dict) -> None:
        """Empty ``metrics`` in place for this (shadow) microbatch; :meth:`_unstash_metrics` refills it.

        Shadow microbatches come last in a step (padding follows the real ones), so once stashed,
        the metrics stay out until the step or eval batch ends.
        """
        if self._stashed_metrics is None:
            self._stashed_metrics = (metrics, dict(metrics))
        metrics.clear()

    def _unstash_metrics(self) -> None:
        if self._stashed_metrics is not None:
            metrics, saved = self._stashed_metrics
            metrics.update(saved)
            self._stashed_metrics = None

    # -- EPOCH_END ---------------------------------------------------------------------------------

    def _epoch_end(self, logger: Logger) -> None:
        self._train_loader.check_ended_together()
        report = self._train_loader.report
        if isinstance(self._train_loader.dataloader, RebalancingLoader):
            self._train_loader.dataloader.complete(report)
        self.reports.append(report)
        logger.log_metrics(report.metrics())  # type: ignore[arg-type]  # ints are floats to a logger
        if self._rank == 0:
            log.info('UnevenJoin %s', report.summary())


def is_shadow_step(state: State) -> bool:
    """True if this rank is running a shadow step: it has run out of data and only keeps the others company.

    Meant for callbacks that should skip shadow steps (e.g. per-rank data statistics). Outside
    training and evaluation, or without an active :class:`UnevenJoin`, it is False.

    Example::

        class CountRealSteps(Callback):
            def batch_end(self, state, logger):
                if not is_shadow_step(state):
                    self.steps += 1
    """
    if not isinstance(state, State):
        raise TypeError(f"is_shadow_step(state) takes the trainer's State (trainer.state), got {type(state).__name__}")
    return any(isinstance(a, UnevenJoin) and a.is_shadow_step for a in state.algorithms)
