"""The trainers one ``UnevenJoin`` object serves, each with its own run, told apart by their ``State`` (by identity).

A Composer ``Algorithm`` is given to a ``Trainer``, and nothing stops a user from giving the same object to a second
one (a sweep, a notebook). Each Trainer has its own ``State``, and every event comes with it: :class:`Runs` keeps,
per ``State``, whether UnevenJoin is active for that Trainer and its :class:`~composer_join.join.session.Run` (made at
that Trainer's first active start event), or, where it is inactive, what a checkpoint gave it. The run of the Trainer
that sent the latest event is the *current* one, for what Composer asks without a ``State`` (the algorithm pass,
``UnevenJoin.reports``).

A checkpoint loaded (``UnevenJoin.load_state_dict``) is the Trainer's whose ``State`` loads it, where that is known
(Composer's ``State.load_state_dict`` calls it); until that Trainer's first start event it is *pending*.

Memory: each Trainer's run, and through it its ``State`` (model, optimizer), is kept while the ``UnevenJoin`` object
lives, so that its checkpoint entry and reports stay its own (the run refers to its ``State``: a weak key could never
be freed). A sweep that makes many Trainers with one ``UnevenJoin`` keeps them all; one ``UnevenJoin()`` per Trainer
keeps none.
"""

from __future__ import annotations

from typing import Any, Optional

from composer.core import State

from composer_join.core.report import EpochReport
from composer_join.data.resume import Resumed
from composer_join.join.session import Run

__all__ = ['Runs']


class Runs:
    """Per Trainer (its ``State``, by identity): active or not, its run, what a checkpoint gave it.

    Cost: a dictionary look-up at the first event from another Trainer than the last one; none otherwise.
    """

    def __init__(self) -> None:
        # id(state) -> (state, its run or None where inactive, what a checkpoint gave an inactive trainer)
        self._entries: dict[int, tuple[State, Optional[Run], Optional[Resumed]]] = {}
        self._state: Optional[State] = None  # the Trainer that sent the latest event, and its run
        self._run: Optional[Run] = None
        # a checkpoint loaded before its Trainer's first start event, and that Trainer's State (None: not known)
        self._pending: Optional[tuple[Optional[State], Resumed]] = None

    def _entry(self, state: Any) -> Optional[tuple[State, Optional[Run], Optional[Resumed]]]:
        entry = self._entries.get(id(state))
        return entry if entry is not None and entry[0] is state else None

    def decided(self, state: State) -> bool:
        """Whether this Trainer has had its first start event (UnevenJoin active or not for it)."""
        return self._entry(state) is not None

    def of(self, state: State) -> Optional[Run]:
        """This Trainer's run (None: inactive, or not started); it is the current one from now on."""
        if state is not self._state:
            entry = self._entry(state)
            self._state, self._run = state, entry[1] if entry is not None else None
        return self._run

    def get(self, state: State) -> Optional[Run]:
        """This Trainer's run, the current one unchanged."""
        entry = self._entry(state)
        return entry[1] if entry is not None else None

    @property
    def current(self) -> Optional[Run]:
        """The run of the Trainer that sent the latest event (None: inactive for it, or none yet)."""
        return self._run

    def add(self, state: State, run: Optional[Run], resumed: Optional[Resumed]) -> None:
        """At this Trainer's first start event: its run (None where inactive; then what a checkpoint gave it)."""
        self._entries[id(state)] = (state, run, None if run is not None else resumed)
        self._state, self._run = state, run

    def take_pending(self, state: State) -> Optional[Resumed]:
        """At this Trainer's first start event: the checkpoint loaded for it before, if any (one loaded where the
        loading ``State`` was not known goes to the first Trainer that starts)."""
        pending = self._pending
        if pending is None or pending[0] not in (None, state):
            return None
        self._pending = None
        return pending[1]

    def load(self, state: Optional[State], resumed: Resumed) -> Optional[Run]:
        """A checkpoint loaded by ``state`` (None: not known, then the current Trainer's): its run, where it has one
        (which takes it), else it is pending (or kept, for an inactive Trainer's own checkpoint entry)."""
        entry = self._entry(state) if state is not None else None
        if state is None and self._state is not None:
            entry = self._entry(self._state)
        if entry is not None and entry[1] is not None:
            return entry[1]
        if entry is not None:  # inactive for that Trainer
            self._entries[id(entry[0])] = (entry[0], None, resumed)
        else:
            self._pending = (state, resumed)
        return None

    def saved_by(self, state: Optional[State]) -> tuple[Optional[Run], Optional[Resumed]]:
        """For a checkpoint saved by ``state`` (None: not known, then the current Trainer's): its run, or where it has
        none, what a checkpoint gave it (or the pending one)."""
        entry = self._entry(state) if state is not None else None
        if state is None and self._state is not None:
            entry = self._entry(self._state)
        if entry is not None:
            return entry[1], entry[2]
        pending = self._pending
        return None, pending[1] if pending is not None and pending[0] in (None, state) else None

    def reports(self, state: Optional[State]) -> list[EpochReport]:
        """The epoch reports of ``state``'s Trainer (None: the current one): its run's list (which its fits append
        to), else a copy of what a checkpoint gave it, else ``[]``."""
        run, resumed = self.saved_by(state)
        return run.reports if run is not None else list(resumed.reports) if resumed is not None else []
