"""Rank-side scenarios for tests/test_identity.py: evaluators and trainers told apart by identity. Not a test module.

Issue 46, cases 2 and 6, on :class:`scenarios_learned.SeqModel` over this rank's shards of
:data:`scenarios_learned.DATA` (rank ``short`` the short one):

* :func:`two_evals`: evaluation batches with a list of names (:func:`named_loader`); a Trainer built with its own ``eval_dataloader`` (labelled ``'eval'``) fits, then
  ``trainer.eval(eval_dataloader=...)`` evaluates another dataloader, which Composer also labels ``'eval'`` and appends
  after the Trainer's evaluator, then ``trainer.eval()`` the Trainer's own again. With ``sizes``, each evaluator has
  its own ``device_eval_microbatch_size``.
* :func:`two_trainers`: one ``UnevenJoin`` object given to two Trainers (each its own model and optimizer), their
  calls interleaved (``cfg['calls']``: ``(trainer, 'fit A')``, ...). Besides the results of the calls, what each
  Trainer's own checkpoint entry holds (its ``State.state_dict()``: UnevenJoin's reports) and what
  ``is_shadow_step(state)`` said per step.

``cfg['join']`` False runs the same calls without UnevenJoin (stock Composer). A call that raises ends the scenario,
its error kept.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback, Evaluator
from composer.utils import dist
from torch.utils.data import DataLoader

import composer_join
from composer_join import UnevenJoin, is_shadow_step
from rank_scenarios import quiet_trainer
from scenarios_learned import BATCH, SeqModel, Shard, TrainTokens, loader, samples
from toy_seq import LR, MOMENTUM, collate


def _params(model: SeqModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}


def _eval_result(trainer) -> dict[str, Any]:
    values = trainer.state.eval_metric_values
    return {'Tokens': values['Tokens'].cpu().clone(), 'MeanLoss': float(values['MeanLoss'])}


def _fit_result(trainer, model: SeqModel, recorder: TrainTokens) -> dict[str, Any]:
    return {'train_tokens': recorder.steps, 'params': _params(model), 'samples': int(trainer.state.timestamp.sample)}


def _named(items: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`toy_seq.collate`, and each sample's name in a list (as text reaches a model): Composer's default
    ``split_batch`` splits a list with ``range(0, len, size)``, and takes the size down to the length of a shorter
    one, so it cannot split a batch of no samples (``range() arg 3 must not be zero``)."""
    return {**collate([{k: v for k, v in s.items() if k != 'name'} for s in items]), 'name': [s['name'] for s in items]}


def named_loader(name: str, rank: int, short: int) -> DataLoader:
    """This rank's shard of ``name`` (:func:`scenarios_learned.loader`), each sample also named."""
    items = [{**s, 'name': f'{name}{rank}.{i}'} for i, s in enumerate(samples(name, rank, short))]
    return DataLoader(Shard(items), batch_size=BATCH, collate_fn=_named)


def _evaluator(name: str, rank: int, short: int, size: Any) -> Any:
    data = named_loader(name, rank, short)
    return data if size is None else Evaluator(label='eval', dataloader=data, device_eval_microbatch_size=size)


def _close(trainers: list) -> None:
    """Close each trainer; what a close raises after a call raised is not the error the test reports."""
    for trainer in trainers:
        try:
            trainer.close()
        except Exception:
            pass


def two_evals(cfg: dict) -> dict[str, Any]:
    """Fit on ``cfg['train']`` (the Trainer's own evaluator on ``cfg['own']`` runs at the epoch's end), evaluate
    ``cfg['other']`` through ``trainer.eval(eval_dataloader=...)``, then the Trainer's own through ``trainer.eval()``.
    Results: the fit's, the evaluation at the fit's end, the other evaluation, the own one again."""
    rank, short = dist.get_global_rank(), cfg['short']
    sizes = cfg.get('sizes') or (None, None)
    model, recorder = SeqModel(), TrainTokens()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader(cfg['train'], rank, short),
        eval_dataloader=_evaluator(cfg['own'], rank, short, sizes[0]),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        algorithms=[UnevenJoin()] if cfg['join'] else [],
        callbacks=[recorder],
    )
    results: list[dict[str, Any]] = []
    error = None
    try:
        trainer.fit()
        results += [_fit_result(trainer, model, recorder), _eval_result(trainer)]
        trainer.eval(eval_dataloader=_evaluator(cfg['other'], rank, short, sizes[1]))
        results.append(_eval_result(trainer))
        trainer.eval()
        results.append(_eval_result(trainer))
    except Exception as e:  # the test names the call and its error
        error = (len(results), f'{type(e).__name__}: {e}')
    _close([trainer])
    return {'results': results, 'error': error, 'composer_join': composer_join.__file__}


class ShadowSteps(Callback):
    """Per training step, what :func:`is_shadow_step` says of this trainer's state."""

    def __init__(self):
        self.steps: list[bool] = []

    def batch_end(self, state, logger):
        self.steps.append(is_shadow_step(state))


def _reports(trainer) -> list[list[int]]:
    """The real samples per rank of every epoch in UnevenJoin's entry of this Trainer's own ``State.state_dict()``."""
    algorithms = trainer.state.state_dict()['algorithms']
    entries = [entry for name, entry in algorithms if name == 'UnevenJoin']
    return [list(r['real_samples']) for r in entries[0]['reports']] if entries else []


def two_trainers(cfg: dict) -> dict[str, Any]:
    """``cfg['calls']``: ``[(trainer index, 'fit A' | 'eval X'), ...]`` on two Trainers sharing one ``UnevenJoin``.

    Each Trainer's first fit trains its own ``train_dataloader``; a later one ``fit(train_dataloader=...,
    duration='1ep', reset_time=True)``. Results per call as in :mod:`scenarios_learned` (a fit's also its
    ``is_shadow_step`` per step); at the end each Trainer's checkpoint entry's reports."""
    rank, short = dist.get_global_rank(), cfg['short']
    calls = [(t, *c.split()) for t, c in cfg['calls']]
    join = UnevenJoin() if cfg['join'] else None
    trainers, models, recorders, shadows, fitted = [], [], [], [], [False, False]
    for index in (0, 1):
        first = next(name for t, kind, name in calls if t == index and kind == 'fit')
        model, recorder, shadow = SeqModel(), TrainTokens(), ShadowSteps()
        trainers.append(
            quiet_trainer(
                model=model,
                train_dataloader=loader(first, rank, short),
                max_duration='1ep',
                optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                algorithms=[join] if join is not None else [],
                callbacks=[recorder, shadow],
            )
        )
        models.append(model)
        recorders.append(recorder)
        shadows.append(shadow)
    results: list[dict[str, Any]] = []
    error = None
    try:
        for index, kind, name in calls:
            trainer = trainers[index]
            if kind == 'fit':
                recorders[index].steps, shadows[index].steps = [], []
                if fitted[index]:
                    trainer.fit(train_dataloader=loader(name, rank, short), duration='1ep', reset_time=True)
                else:
                    trainer.fit()
                fitted[index] = True
                results.append(
                    {**_fit_result(trainer, models[index], recorders[index]), 'shadow': list(shadows[index].steps)}
                )
            else:
                trainer.eval(eval_dataloader=loader(name, rank, short))
                results.append(_eval_result(trainer))
    except Exception as e:  # the test names the call and its error
        error = (len(results), f'{type(e).__name__}: {e}')
    reports = [_reports(t) for t in trainers] if error is None else []
    _close(trainers)
    return {'results': results, 'error': error, 'reports': reports, 'composer_join': composer_join.__file__}
