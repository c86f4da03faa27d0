"""What UnevenJoin holds for one trainer while it is active: the current sessions, which events they take.

:class:`Run` is made at the trainer's first active start event (``FIT_START``, ``EVAL_START`` or
``PREDICT_START``) by :class:`~composer_join.UnevenJoin`, which asks it at every event whether to run
(:meth:`Run.wants`, for ``match``) and routes the event to it (the algorithm's table). A run holds:

* what its sessions share (:class:`~composer_join.join.context.Context`): the settings, the wrapper part
  (:mod:`composer_join.wrappers`: DDP, FSDP1/2 or none, chosen once), the layout, the reports;
* the current fit (:class:`~composer_join.join.fit.FitSession`: made at ``FIT_START``; after ``FIT_END`` the last
  one, whose report and positions a checkpoint saved after ``fit()`` holds);
* the current evaluation or ``predict()`` (:class:`~composer_join.join.evaluation.EvalSession`: made at its start
  event, dropped at its end), which is the current session while it exists; else the fit is;
* the evaluators' loaders, whose dataloaders the trainer's evaluators still read (what one learned from its
  dataloader goes to the next loader over the same object, :class:`~composer_join.join.loader.Learned`);
* what a checkpoint gave, until the next fit takes it.

Every change to an object UnevenJoin does not own is made per iteration over a dataloader, through the loader's
register of changes (:mod:`composer_join.core.changes`), and undone when that iteration ends, also when the run
raises; what a fit changes on Composer's own ``State`` is in the fit's register, undone at ``FIT_END``. A session a
raised run left is closed at the next start event (its iteration, its register), so nothing of it reaches the next.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from composer.core import DataSpec, Event, State
from composer.utils import dist

from composer_join.core.layout import trainer_layout
from composer_join.data.resume import Resumed
from composer_join.join.context import Context, Settings
from composer_join.join.evaluation import BATCH_EVENTS, EvalSession
from composer_join.join.fit import FIT_EVENTS, FitSession
from composer_join.join.loader import JoinLoader
from composer_join.wrappers import wrapper_for

__all__ = ['Run']

_FIT_IDS, _BATCH_IDS = frozenset(map(id, FIT_EVENTS)), frozenset(map(id, BATCH_EVENTS))


def wrapper_state(resumed: Optional[Resumed]) -> dict[str, Any]:
    """What a checkpoint gave the wrapper part, for this run: nothing from a checkpoint of another world size (under
    DDP the buffer source it names may be no rank here, and every rank loaded the same buffers: rank 0 serves, as
    the fit that resumes it sets too). An evaluation before that fit broadcasts from it (seed 754544: 3 ranks
    resumed on 2, ``eval()`` first, 'invalid root rank: 2')."""
    if resumed is None or resumed.world_size not in (None, dist.get_world_size()):
        return {}
    return resumed.wrapper


class Run:
    """One trainer's UnevenJoin while active: its sessions, and which of Composer's events they take.

    Args:
        state: the trainer's state, at its first active start event.
        settings: UnevenJoin's settings (:class:`~composer_join.join.context.Settings`).
        reports: this trainer's list of finished epochs' reports (a fit appends at ``EPOCH_END``).
        resumed: what a checkpoint gave, if Composer loaded one before this start.
        algorithm: the :class:`~composer_join.UnevenJoin` whose run this is (the trainer's other algorithms are the
            ones besides it).
    """

    def __init__(
        self, state: State, settings: Settings, reports: list, resumed: Optional[Resumed], algorithm: Any = None
    ):
        rank = dist.get_global_rank()
        wrapper = wrapper_for(state, rank)
        wrapper.load_state_dict(wrapper_state(resumed))
        # the data-parallel members: tensor-parallel groups join as one
        self.context = Context(state, settings, wrapper, trainer_layout(state), rank, reports, algorithm)
        self.resumed = resumed  # what a checkpoint gave, until a fit trains a batch from it
        self._resumed_at: Optional[int] = None  # Composer's batch count when the last fit started
        self.fit: Optional[FitSession] = None  # the current fit (or the last one, once ended)
        self.evaluation: Optional[EvalSession] = None  # the current evaluation or predict()
        self.evals: list[JoinLoader] = []  # the evaluators' loaders, while their dataloaders are the trainer's

    @property
    def wrapper(self) -> Any:
        return self.context.wrapper

    @property
    def reports(self) -> list:
        """This trainer's finished epochs' reports (its fits append at ``EPOCH_END``)."""
        return self.context.reports

    @property
    def session(self) -> Optional[Any]:
        """The current session: an evaluation or ``predict()`` while one runs, else the (current or last) fit."""
        return self.evaluation if self.evaluation is not None else self.fit

    def plan(self) -> Any:
        """The current step's plan, while a training step or an evaluation batch runs (else None)."""
        session = self.session
        return session.plan() if session is not None else None

    @property
    def shadow_step(self) -> bool:
        session = self.session
        return session is not None and session.shadow_step

    @property
    def shadows_now(self) -> bool:
        """:func:`~composer_join.is_shadow_step`: the current session's shadow step, or stand-in microbatch."""
        session = self.session
        return session is not None and session.shadows_now

    def wants(self, event: Event, state: State) -> bool:
        """Whether UnevenJoin runs at ``event`` (``match``): the fit's events as its session decides, an evaluation's
        batches while one runs, every start and end."""
        key = id(event)  # (by identity: see composer_join.join.fit)
        if key in _FIT_IDS:
            return self.fit is not None and self.fit.wants(event, state)
        if key in _BATCH_IDS:
            return self.evaluation is not None and self.evaluation.wants(event, state)
        return True

    def shadows(self, event: Event) -> bool:
        """Whether the current microbatch is a stand-in: its record, for the algorithm pass (made at its start)."""
        session = self.session
        record = session.microbatches.current if session is not None else None
        return record is not None and record.shadow

    @property
    def train(self) -> Optional[JoinLoader]:
        """The train loader of the current (or last) fit."""
        return self.fit.loader if self.fit is not None else None

    # -- starts and ends ---------------------------------------------------------------------------

    def _close(self, fit: bool) -> None:
        """At a start event: end the evaluation a run that raised left (and at ``FIT_START`` its fit), and the
        iterations of the evaluators' loaders."""
        if self.evaluation is not None:
            self.evaluation.close()
            self.evaluation = None
        for loader in self.evals:
            loader.close_iteration()
        if fit and self.fit is not None:
            self.fit.close()

    def loaded(self, resumed: Resumed) -> None:
        """Composer loaded a checkpoint into this run's trainer (after a fit of it, say): the next fit starts from it."""
        self.reports[:] = resumed.reports  # (the run appends to this list)
        self.resumed, self._resumed_at = resumed, None
        self.wrapper.load_state_dict(wrapper_state(resumed))

    def fit_start(self, state: State) -> None:
        self._close(fit=True)  # of a run that raised: none goes on now
        # What a checkpoint gave serves each fit until one trains a batch from it (Composer's timestamp moves): a
        # fit that raised before its first batch ended leaves Composer's state as loaded, so the retry starts alike.
        batch = int(state.timestamp.batch)
        if self.resumed is not None and self._resumed_at not in (None, batch):
            self.resumed = None
        self._resumed_at = batch
        self.fit = FitSession(self.context, self.resumed, self.fit)

    def fit_end(self, state: State) -> None:
        self.fit.end(state)

    def eval_start(self, state: State, predict: bool = False) -> None:
        """``EVAL_START``, ``PREDICT_START``: every rank evaluates (or predicts) its whole shard."""
        self._close(fit=False)
        # what was learned from this dataloader object before (never from another under the same label)
        earlier = None if predict else next((x for x in self.evals if x.dataloader is state.dataloader), None)
        self.evaluation = session = EvalSession(self.context, earlier, predict)
        if predict or session.loader is None:
            return
        # kept while an evaluator reads its dataloader (an eval(eval_dataloader=...)'s goes with it)
        dataloaders = [e.dataloader.dataloader for e in state.evaluators if isinstance(e.dataloader, DataSpec)]
        kept = [x for x in self.evals if x is not earlier and _among(x.dataloader, dataloaders)]
        self.evals = [*kept, session.loader]

    def eval_end(self, state: State) -> None:
        """``EVAL_END``, ``PREDICT_END``: stop every rank if some rank could not form a batch; the fit is current."""
        evaluation, self.evaluation = self.evaluation, None
        if evaluation is not None:
            evaluation.end()

    # -- checkpoints -------------------------------------------------------------------------------

    def saved(self) -> dict[str, Any]:
        """What this run puts in UnevenJoin's checkpoint entry; no collective (the positions were gathered before)."""
        fit, resumed, context = self.fit, self.resumed, self.context
        if fit is None:  # no fit yet: what a checkpoint gave, unchanged
            return {
                'current': resumed.current if resumed is not None else None,
                'wrapper': context.wrapper.state_dict(),
                'ranks': resumed.ranks if resumed is not None else None,
                'epoch_done': resumed.epoch_done if resumed is not None else False,
                'groups': context.layout.tp_groups,
                'positions_unsaved': resumed.positions_unsaved if resumed is not None else False,
            }
        ranks, unsaved = fit.positions.entries() if fit.positions is not None else (None, False)
        return {
            'current': fit.loader.report,
            'wrapper': context.wrapper.state_dict(),
            'ranks': ranks,
            'epoch_done': fit.loader.epoch_done(),
            'groups': context.layout.tp_groups,
            'positions_unsaved': unsaved,
        }


def _among(obj: Any, objects: Iterable[Any]) -> bool:
    """Whether ``obj`` is one of ``objects`` (by identity: a dataloader may compare equal to another)."""
    return any(obj is o for o in objects)
