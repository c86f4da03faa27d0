"""Single-process behaviour: world size 1 is stock Composer, the argument checks, and the small pieces."""

from __future__ import annotations

import logging

import pytest
import torch
from composer import Trainer
from composer.core import DataSpec

from composer_join import UnevenJoin
from composer_join.core.batches import first_samples, sample_lists
from composer_join.core.plan import RankStatus, StepPlan, plan_from_lengths
from composer_join.core.report import EpochReport
from composer_join.shadow.gradients import scale_grad
from rank_scenarios import ToyModel, make_loader


def fit(algorithms) -> Trainer:
    model = ToyModel('mlp')
    trainer = Trainer(
        model=model,
        train_dataloader=make_loader(dict(shards=[21], batch_size=8), 0),
        max_duration='2ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=algorithms,
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )
    trainer.fit()
    trainer.close()
    return trainer


def test_world_size_one_is_stock_composer_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger='composer_join'):
        joined = fit([UnevenJoin()])
    stock = fit([])
    assert any('inactive (world size is 1)' in r.getMessage() for r in caplog.records)
    assert int(joined.state.timestamp.sample) == int(stock.state.timestamp.sample) == 42
    for a, b in zip(joined.state.model.parameters(), stock.state.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize('kwarg', ['divide_by_initial_world_size', 'enable', 'throw_on_early_termination'])
def test_arguments_must_be_booleans(kwarg):
    with pytest.raises(TypeError, match=f'{kwarg}=.*must be True or False'):
        UnevenJoin(**{kwarg: 'yes'})


@pytest.mark.parametrize(
    'batch',
    [
        torch.arange(10).reshape(5, 2),
        (torch.zeros(5, 3), torch.ones(5)),
        {'input_ids': torch.zeros(5, 7, dtype=torch.long), 'labels': torch.zeros(5)},
    ],
)
def test_shadow_batches_count_zero_and_split_into_one_microbatch(batch):
    spec = DataSpec([batch])
    shadow = first_samples(batch, 0)
    assert spec.get_num_samples_in_batch(shadow) == 0
    assert spec.get_num_tokens_in_batch(shadow) == 0
    with pytest.warns(UserWarning):  # Composer warns that it cannot split a batch smaller than the microbatch
        assert len(spec.split_batch(shadow, 2)) == 1
    assert spec.get_num_samples_in_batch(first_samples(batch, 2)) == 2


def test_batches_with_lists_of_samples_are_recognised():
    assert sample_lists({'x': torch.zeros(2), 'text': ['a', 'b']})
    assert not sample_lists({'x': torch.zeros(2), 'pair': (torch.zeros(2), torch.ones(2))})


def test_first_samples_do_not_share_memory():
    x = torch.zeros(4, 2)
    copy = first_samples(x, 2)
    copy += 1
    assert x.sum() == 0


def test_scale_grad_keeps_value_and_scales_gradient_of_every_loss():
    w = torch.ones(3, requires_grad=True)
    losses = scale_grad({'a': (w * 2).sum(), 'b': w.sum(), 'n': torch.tensor(1.0)}, 0.25)
    assert float(losses['a']) == 6.0 and float(losses['b']) == 3.0
    (losses['a'] + losses['b']).backward()
    assert w.grad.tolist() == [0.75, 0.75, 0.75]
    shadow = scale_grad((w * float('inf')).sum(), 0.0)
    w.grad = None
    shadow.backward()
    assert w.grad.isnan().all()  # a zero weight cannot clean an infinite activation: documented limit


def test_plan_factor_and_microbatch_agreement():
    plan = StepPlan(3, (RankStatus(True, 8, 3), RankStatus(False, 0, 1), RankStatus(True, 5, 2)))
    assert plan.active_ranks == [0, 2] and plan.joined_ranks == [1]
    assert plan.grad_factor(True) == pytest.approx(2 / 3) and plan.grad_factor(False) == 1.0
    assert not plan.even_microbatches
    assert StepPlan(0, (RankStatus(True, 8, 3), RankStatus(True, 7, 3))).even_microbatches
    assert not StepPlan(0, (RankStatus(True, -1, 0), RankStatus(True, -1, 0))).even_microbatches


def test_report_counts_what_stock_composer_drops():
    report = EpochReport(epoch=0, world_size=2)
    for sizes in ([8, 8], [8, 5], [8, None], [4, None]):
        report.record(StepPlan(0, tuple(RankStatus(s is not None, s or 0, 1) for s in sizes)))
    assert report.real_batches == [4, 2] and report.shadow_steps == [0, 2] and report.real_samples == [28, 13]
    assert report.stock_dropped_batches == 2 and report.stock_dropped_samples == 12
    assert 'stock Composer would have dropped 2 batches (12 samples)' in report.summary()


def _old_stock_dropped(sizes: list[list[int]], real_batches: list[int]) -> int:
    """What 0.1.0 computed from its ``batch_sizes`` lists: each rank's sizes past the shortest rank's count."""
    tails = [v for s in sizes for v in s[min(real_batches) :]]
    return -1 if any(v < 0 for v in tails) else sum(tails)


@pytest.mark.parametrize('seed', range(20))
def test_the_report_summary_is_what_per_step_sizes_gave(seed):
    """Issue 48: the report keeps per rank a few numbers, never a list per step, and they give what the per-step sizes
    gave: random epochs (some steps planned from the lengths, a rank out of data stays out, empty shards, an
    uncountable batch now and then), against the 0.1.0 computation on the sizes; its state is O(W) plain data."""
    import pickle
    import random

    rng = random.Random(seed)
    world = rng.randint(1, 6)
    lengths = [rng.choice([0, rng.randint(1, 9)]) if rng.random() < 0.2 else rng.randint(1, 9) for _ in range(world)]
    sizes = [[rng.choice([4, 4, 4, 3, -1 if rng.random() < 0.1 else 2]) for _ in range(n)] for n in lengths]
    planned = rng.randint(0, max(0, min(lengths) - 1))  # the steps before the shortest rank's last batch, or fewer
    report = EpochReport(epoch=0, world_size=world)
    for t in range(planned):
        report.record(plan_from_lengths(t, 0, RankStatus(True, sizes[0][t], 1), world))
    for t in range(planned, max(lengths)):
        unreported = [sizes[r][:planned] for r in range(world)] if t == planned else [[]] * world
        report.record(
            StepPlan(
                t,
                tuple(
                    RankStatus(
                        t < n,
                        sizes[r][t] if t < n else 0,
                        1,
                        unreported_samples=-1 if any(v < 0 for v in unreported[r]) else sum(unreported[r]),
                    )
                    for r, n in enumerate(lengths)
                ),
            )
        )
    assert report.real_batches == lengths and report.shadow_steps == [max(lengths) - n for n in lengths]
    assert report.real_samples == [-1 if any(v < 0 for v in s) else sum(s) for s in sizes]
    assert report.stock_dropped_samples == _old_stock_dropped(sizes, lengths)
    assert report.stock_dropped_batches == sum(n - min(lengths) for n in lengths)
    state = report.state()
    assert all(isinstance(v, int) or len(v) in (0, world) for v in state.values())  # O(W), whatever the steps
    assert all(isinstance(x, int) for v in state.values() if isinstance(v, list) for x in v)
    again = EpochReport(**state)
    assert again == report and again.metrics() == report.metrics() and again.summary() == report.summary()
    assert pickle.loads(pickle.dumps(report)) == report
    with pytest.warns(DeprecationWarning, match='batch_sizes is deprecated'):
        assert report.batch_sizes == [[] for _ in range(world)]


def test_a_checkpoint_of_0_1_0_with_batch_sizes_lists_still_restores():
    """A 0.1.0 checkpoint entry holds each report's ``batch_sizes`` lists (-1: a planned step): they load as the
    summary, with the same metrics, and a partial epoch's report goes on recording."""
    import pickle

    from composer_join.data.resume import restore

    finished = dict(epoch=0, world_size=2, real_batches=[4, 2], real_samples=[28, 13], shadow_steps=[0, 2])
    finished['batch_sizes'] = [[-1, 8, 8, 4], [-1, 5]]
    partial = dict(epoch=1, world_size=2, real_batches=[2, 1], real_samples=[16, 8], shadow_steps=[0, 1])
    partial['batch_sizes'] = [[-1, 8], [-1]]
    resumed = restore({'reports': [finished], 'current': partial, 'wrapper': {}})
    assert resumed.world_size == 2
    (report,) = resumed.reports
    assert (report.real_batches, report.real_samples, report.shadow_steps) == ([4, 2], [28, 13], [0, 2])
    assert report.tail_samples == [12, 0] and report.stock_dropped_samples == 12
    assert report.metrics()['uneven_join/stock_would_drop_samples'] == 12 and 'batch_sizes' not in report.state()
    current = resumed.current
    assert current is not None and current.tail_samples == [8, 0]
    current.record(StepPlan(2, (RankStatus(True, 4, 1), RankStatus(False, 0, 1))))
    assert current.tail_samples == [12, 0] and current.stock_dropped_samples == 12 and current.real_batches == [3, 1]
    uncountable = dict(finished, batch_sizes=[[-1, 8, -1, 4], [-1, 5]])
    assert EpochReport.from_state(uncountable).stock_dropped_samples == -1
    old_object = EpochReport(**{k: v for k, v in finished.items() if k != 'batch_sizes'})  # pickled by 0.1.0:
    old_object.__dict__['batch_sizes'] = finished['batch_sizes']  # its __dict__ held the lists
    del old_object.__dict__['tail_samples']
    assert pickle.loads(pickle.dumps(old_object)) == report
