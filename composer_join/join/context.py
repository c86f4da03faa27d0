"""What one trainer's sessions share while UnevenJoin is active: its settings, the wrapper part, the layout, the reports.

:class:`Context` is made once per trainer, with the run (:class:`~composer_join.join.session.Run`), at its first
active start event, and handed to every session the run starts (a fit's, :mod:`composer_join.join.fit`; an
evaluation's or ``predict()``'s, :mod:`composer_join.join.evaluation`). It is frozen: nothing a session does changes
it; the wrapper part and the reports list are objects of their own, which the sessions call and append to.

Example::

    context = Context(state, Settings('shadow', True, False, row), wrapper_for(state, rank), layout, rank, [], join)
    facts = context.facts(state, repeats=False)  # this rank's facts for a first agreement
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer.core import State

from composer_join.core.layout import Layout
from composer_join.core.report import EpochReport
from composer_join.core.settings import Facts
from composer_join.wrappers.wrapper import Wrapper

__all__ = ['Context', 'Settings']


@dataclass(frozen=True)
class Settings:
    """UnevenJoin's settings, as its constructor took them, and their row in the first agreement."""

    mode: str
    divide: bool
    """``divide_by_initial_world_size``."""
    throw: bool
    """``throw_on_early_termination``."""
    row: tuple[int, ...]
    """:func:`composer_join.core.settings.row`: compared across ranks in every first agreement."""


@dataclass(frozen=True)
class Context:
    """One trainer's UnevenJoin while active, as its sessions see it."""

    state: State
    settings: Settings
    wrapper: Wrapper
    """The wrapper part (:mod:`composer_join.wrappers`), chosen once for the trainer's model."""
    layout: Layout
    """The data-parallel members: tensor-parallel groups join as one (:mod:`composer_join.core.layout`)."""
    rank: int
    reports: list[EpochReport]
    """The algorithm's finished epochs' reports (a fit appends at ``EPOCH_END``)."""
    algorithm: Any
    """The :class:`~composer_join.UnevenJoin`: the trainer's other algorithms are the ones besides it."""

    def facts(self, state: State, **facts: Any) -> Facts:
        """This rank's :class:`~composer_join.core.settings.Facts` at a start event, for its first agreement."""
        others = sum(1 for a in state.algorithms if a is not self.algorithm)
        return Facts(others=others, label=state.dataloader_label or 'train', **facts)
