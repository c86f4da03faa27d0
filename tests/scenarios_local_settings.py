"""Rank side of tests/test_local_settings.py: ranks whose own settings differ. Not a test module.

Every scenario is a data-pipeline case (:func:`scenarios_pipelines.run_case`: two epochs, an evaluation after each,
``predict()``, checkpoints every batch and a run resumed from one) in which one rank, ``odd``, differs from the
others by ``cfg['odd']`` (its DataLoader's workers, a shuffle buffer, a sampler, its dataset's class), or by an
algorithm (``others``), or calls ``State.state_dict()`` on its own; or a short run that must stop every rank.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from composer import Algorithm, Callback
from composer.core import Event
from composer.utils import checkpoint, dist
from torch.utils.data import DataLoader, DistributedSampler

from composer_join import UnevenInputsError
from pipeline_data import EVAL_IDS, IdMap, SizedWorkerShards, collate_ids
from rank_scenarios import ToyModel, quiet_trainer
from scenarios_pipelines import evaluator, fit, make_loader, run_case


class AtDataloader(Algorithm):
    """Does nothing, at ``AFTER_DATALOADER``, on ``ranks`` only (None: every rank): an algorithm that matches on
    some ranks (its ``match`` reads something of the rank's own, a batch, a random draw, a setting)."""

    def __init__(self, ranks: Optional[list[int]] = None):
        self.ranks = ranks
        self.applied = 0

    def match(self, event: Event, state: Any) -> bool:
        return event == Event.AFTER_DATALOADER and (self.ranks is None or dist.get_global_rank() in self.ranks)

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        self.applied += 1


class StateDictAlone(Callback):
    """Calls ``State.state_dict()`` on this rank alone after every batch (a rank-0 logger of the state, say) and
    keeps UnevenJoin's entries."""

    def __init__(self):
        self.entries: list[dict[str, Any]] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.entries.append(dict(state.state_dict()['algorithms'])['UnevenJoin'])


class SaveAt(Callback):
    """Saves a checkpoint on every rank with Composer's own function at ``BATCH_END`` of batch ``batch``: not at one
    of Composer's checkpoint events."""

    def __init__(self, folder: str, batch: int):
        self.folder, self.batch = folder, batch

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            checkpoint.save_checkpoint(state, os.path.join(self.folder, 'ep{epoch}-ba{batch}-rank{rank}.pt'))


def case(name: str, cfg: dict, folder: str, odd: int) -> dict[str, Any]:
    """``{'case': run_case's, 'applied', 'state_dict_alone'}``: :func:`run_case` with rank ``odd``'s settings ``cfg['odd']``; ``cfg['others']``: ``'odd_rank'`` (an
    :class:`AtDataloader` on rank ``odd`` only) or ``'odd_match'`` (one on every rank, matching on rank ``odd``);
    ``cfg['state_dict_alone']``: rank ``odd`` calls ``State.state_dict()`` alone after every batch."""
    rank = dist.get_global_rank()
    mine = dict(cfg, **cfg.get('odd', {})) if rank == odd else dict(cfg)
    algorithms: tuple = ()
    if cfg.get('others') == 'odd_rank':
        algorithms = (AtDataloader(),) if rank == odd else ()
    elif cfg.get('others') == 'odd_match':
        algorithms = (AtDataloader([odd]),)
    alone = StateDictAlone()
    callbacks = (alone,) if cfg.get('state_dict_alone') and rank == odd else ()
    return {
        'case': run_case(name, mine, folder, algorithms=algorithms, callbacks=callbacks),
        'applied': sum(a.applied for a in algorithms),  # in every fit
        'state_dict_alone': [{k: e.get(k) for k in ('ranks', 'positions_unsaved')} for e in alone.entries],
    }


def _error(run: Any) -> Optional[str]:
    """``run()``; the message of the :class:`UnevenInputsError` it raised, else None."""
    try:
        run()
    except UnevenInputsError as e:
        return str(e)
    return None


def repeats(odd: int) -> dict[str, Optional[str]]:
    """An evaluation and a ``predict()`` whose dataloader shards with torch's ``DistributedSampler`` on rank ``odd``
    (5 samples over 2 ranks: it repeats one to even the shards out) and is a per-rank ``IterableDataset`` elsewhere:
    what each raised on this rank."""
    rank = dist.get_global_rank()

    def loader() -> DataLoader:
        if rank == odd:
            dataset = IdMap(EVAL_IDS, 5)
            return DataLoader(
                dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False), collate_fn=collate_ids
            )
        ids = list(range(EVAL_IDS + 10 * (rank + 1), EVAL_IDS + 10 * (rank + 1) + 3))
        return DataLoader(SizedWorkerShards(ids, len(ids)), batch_size=2, collate_fn=collate_ids)

    from composer_join import UnevenJoin

    trainer = quiet_trainer(
        model=ToyModel('mlp'), eval_dataloader=evaluator(loader(), ['MulticlassAccuracy']), algorithms=[UnevenJoin()]
    )
    try:
        return {'eval': _error(trainer.eval), 'predict': _error(lambda: trainer.predict(loader()))}
    finally:
        trainer.close()


def left_to_composer(name: str, cfg: dict, folder: str) -> dict[str, Any]:
    """A per-rank dataset of Composer's protocol that is not registered: the uninterrupted run, then the run resumed
    from its checkpoint (``cfg['resume_at']``); the warnings this rank gave and the error the resumed run raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        error = _error(lambda: run_case(name, cfg, folder))
    return {'error': error, 'warnings': [str(w.message) for w in caught if 'UnevenJoin' in str(w.message)]}


def saved_elsewhere(name: str, cfg: dict, folder: str) -> dict[str, Any]:
    """Data that keeps its own position, a checkpoint saved on every rank at ``BATCH_END`` of batch 1 (not a
    checkpoint event of Composer's), then a run resumed from it: what the resumed run raised."""
    folder = os.path.join(folder, name)
    manual = os.path.join(folder, 'manual')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fit(cfg, folder, callbacks=(SaveAt(manual, 1),))
    resumed = _error(lambda: fit(cfg, folder, load_path=os.path.join(manual, 'ep0-ba1-rank0.pt')))
    return {'error': resumed, 'warnings': [str(w.message) for w in caught if 'state_dict()' in str(w.message)]}


def marked(odd: int, cfg: dict) -> Optional[str]:
    """A fit whose model has a module marked ``shadow_forward = True`` (its forward communicates, so shadow
    microbatches run it) on rank ``odd`` only: what it raised on this rank."""
    from composer_join import UnevenJoin

    model = ToyModel('mlp')
    if dist.get_global_rank() == odd:
        model.module.shadow_forward = True
    train = make_loader(cfg['data'], cfg['sizes'], 0, cfg, '')
    trainer = quiet_trainer(model=model, train_dataloader=train, max_duration='1ep', algorithms=[UnevenJoin()])
    try:
        return _error(trainer.fit)
    finally:
        trainer.close()
