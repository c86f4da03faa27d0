"""UnevenJoin's algorithm pass (``composer_join.join.passes``), in one process: where it places UnevenJoin per event."""

from __future__ import annotations

from composer.algorithms import LabelSmoothing, MixUp
from composer.core import Event, engine

from composer_join import UnevenJoin
from composer_join.join.passes import join_pass


def test_import_registers_the_pass_after_composers_own():
    passes = engine._get_default_passes()
    assert passes[-1] is join_pass and passes.count(join_pass) == 1


def test_places_uneven_join_first_last_or_alone(monkeypatch):
    join, mixup, smoothing = UnevenJoin(), MixUp(), LabelSmoothing()
    listed = [mixup, smoothing, join]  # as a YAML might list them
    monkeypatch.setattr(join, 'shadows_microbatch', lambda event: False)  # a real microbatch
    assert join_pass(listed, Event.BEFORE_LOSS) == [join, mixup, smoothing]
    assert join_pass(listed, Event.BEFORE_BACKWARD) == [mixup, smoothing, join]  # weights the final loss
    assert join_pass(listed, Event.AFTER_LOSS) == [mixup, smoothing, join]
    assert join_pass(listed, Event.FIT_START) == [mixup, smoothing, join]  # the others see the user's loader
    # AFTER_DATALOADER (UnevenJoin matches it only where some rank's trainer has other algorithms, agreed at
    # FIT_START): it re-gathers the counts last, whether or not the others match on this rank
    assert join_pass(listed, Event.AFTER_DATALOADER) == [mixup, smoothing, join]
    assert join_pass([join], Event.AFTER_DATALOADER) == [join]  # none matches here: the counts all the same
    monkeypatch.setattr(join, 'shadows_microbatch', lambda event: True)  # a shadow one: no other algorithm sees it
    for event in (
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
        Event.EVAL_AFTER_FORWARD,
        Event.PREDICT_AFTER_FORWARD,
    ):
        assert join_pass(listed, event) == [join]
    assert join_pass([mixup, smoothing], Event.BEFORE_LOSS) == [mixup, smoothing]  # no UnevenJoin: unchanged
    assert join.pass_seen
