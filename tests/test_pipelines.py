"""The data-pipeline matrix (issue 27): real DataLoaders, workers, Hugging Face ``datasets``, ``StreamingDataset``.

Each case is a 2-epoch fit on 2 ranks (an evaluation after each epoch, then ``predict()``), run by
:func:`scenarios_pipelines.run_case`; every sample is an id. Every case must show:

* every train id trained exactly once per epoch, across the ranks (and every eval id predicted once);
* the replicas identical (every rank's final weights equal);
* the final weights equal to a single-process replay of the steps the ranks recorded (:func:`replay`);
* every evaluation's metrics equal to one process evaluating all eval ids with that evaluation's weights;
* the user's dataloader, dataset and sampler left as they were (attribute names; they still pickle; a dataset
  of these tests pickles to the same bytes);
* with ``resume_at``: a run resumed from each checkpoint it names trains the same ids at every later step and ends
  with the same weights as the uninterrupted run. A position is a batch ``k`` (the checkpoint after batch ``k`` of
  epoch 0, mid-epoch), ``'epoch_end'`` (the checkpoint after epoch 0's last batch: still in epoch 0, its data all
  read) or ``'ep1'`` (the epoch checkpoint Composer saves after epoch 0 ends, at epoch 1's start).

Refused rows must stop every rank with an error that says what to use instead.

The covering set (not every combination; every value of every axis appears, with the risky pairs):

=========================================  ===============  ==========================  =========  ======
case                                        data             workers                     mode       resume
=========================================  ===============  ==========================  =========  ======
map_exact_w0_shadow                         ExactDistributedSampler  0                  shadow     yes
map_uneven_w2_persistent_rebalance          uneven DistributedSampler  2 persistent pf4 rebalance  yes
iter_nolen_w2_shadow_short_first            IterableDataset, no len  2                  shadow     no
iter_exact_w0_rebalance                     IterableDataset, exact len  0                rebalance  yes
iter_under_w2_shadow                        IterableDataset, len undercounts  2         shadow     no
iter_exact_w2_spawn_persistent_shadow       IterableDataset, exact len  2 spawn persistent pf4  shadow  no
iter_nolen_w2_persistent_rebalance_empty_first  no len, an empty rank  2 persistent     rebalance  no
iter_exact_w0_shadow_empty_last             exact len, an empty rank  0                 shadow     no
plain_state_w0_rebalance                    HF-style state_dict(), len  0               rebalance  yes
hf_iterable_w0_shadow                       to_iterable_dataset + split_dataset_by_node  0  shadow  yes
hf_generator_w2_shadow                      from_generator, uneven files  2            shadow     no
hf_map_w2_forkserver_persistent_rebalance        map-style + split_dataset_by_node  2 forkserver persistent  rebalance  no
hf_map_w0_shadow                            map-style + split_dataset_by_node  0        shadow     yes
streaming_w0_shadow                         local StreamingDataset  0                   shadow     yes
streaming_w2_rebalance                      local StreamingDataset  2                   rebalance  no
wds_w0_shadow_short_first                   webdataset tar shards, split_by_node, no len  0   shadow     2
wds_w2_rebalance                            webdataset, split_by_worker, no len  2          rebalance  no
wds_webloader_w2_shadow                     webdataset batched, WebLoader (not a DataLoader)  2  shadow  no
sdl_map_uneven_w2_shadow_short_first        StatefulDataLoader, uneven DistributedSampler  2  shadow  2, ep1
sdl_iter_exact_w0_rebalance                 StatefulDataLoader, IterableDataset, exact len  0  rebalance  2, epoch_end
litdata_sdl_w2_shadow                       litdata StreamingDataset + StreamingDataLoader (4/11)  2  shadow  2
litdata_torch_w0_rebalance                  litdata StreamingDataset + torch DataLoader (4/5)  0  rebalance  epoch_end
hf_filter_shuffle_w0_shadow                 HF split_dataset_by_node, .filter(), .shuffle(buffer) (6/4)  0  shadow  1, epoch_end
hf_filter_shuffle_w2_rebalance_short_first  the same, another seed (4/6)  2          rebalance  ep1
hf_read_before_fit_w0_shadow                the same, next(iter(dataset)) before fit()  0  shadow     ep1
hf_count_before_fit_w0_rebalance_short_first  the same, every row read before fit()  0     rebalance  ep1
refused: wds_len_high_w0_shadow             webdataset .with_length(whole dataset): len() overcounts on every rank
refused: hf_iterable_w2_resume              HF iterable, 2 workers, mid-epoch checkpoint: stops every rank
refused: iter_under_w2_rebalance_short_first  IterableDataset, len undercounts, 2 workers, rebalance: stops every rank
refused: hf_iterable_w0_rebalance_resume    HF iterable (no len) rebalancing, mid-epoch checkpoint: stops every rank
=========================================  ===============  ==========================  =========  ======

The last rows (issue 33) run real data libraries: webdataset 1.0 (tar shards written into the launch's folder;
``split_by_node`` gives each rank every other shard, so the ranks' counts follow the shard sizes), torchdata 0.11's
``StatefulDataLoader`` (Composer never asks the loader for its state: it resumes by spinning), litdata 0.2.76
(``optimize()``d into the launch's folder; ``StreamingDataset(drop_last=False)`` splits the samples over the ranks
itself: 4/11 of 15 through its ``StreamingDataLoader``, 4/5 of 9 through a torch ``DataLoader``) and Hugging Face
``datasets`` with a data-dependent ``.filter()`` after ``split_dataset_by_node`` and a shuffle buffer, read before
``fit()`` in two rows. Known failures on 0.1.x (docs/data-pipelines.md): the litdata rows (``TypeError`` at
``FIT_START``: litdata's ``state_dict`` takes three arguments), the HF rows resumed mid-epoch through a shuffle buffer
(Hugging Face's state drops the buffer's content) and the HF rows read before ``fit()`` (the epoch start UnevenJoin
saves is where that read stopped).

Risky pairs: persistent workers x evaluation (every case evaluates twice, predicts after), a pickling worker
start x Hugging Face (the forkserver case), undercounting len() x both modes (shadow trains, rebalance refuses;
predict() over it predicts every id once), resume x every dataset kind. One ``spawn`` row: each spawn worker
imports torch (about 3 s of CPU; ``pipeline_data`` imports only torch), so it is persistent (3 starts of 2 workers
per rank instead of 6). Ranks are permuted by the order of ``sizes``: the short or empty rank first or last.
Fork everywhere else ``workers`` is 2.

Stock Composer (no algorithm) runs on each row's pipeline too (:func:`scenarios_pipelines.run_stock`: the first
epoch and its evaluation); docs/data-pipelines.md's stock column must say what it measured
(:func:`test_docs_stock_column_is_the_measured_one`). All cases, the refused ones and the stock runs share one
2-rank launch with a hard timeout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fork_guard
from harness import RankError, launch
from pipeline_data import EVAL_IDS, X, Y, kept, replay
from reference import max_abs_diff
from test_join_core import ok
from toy import make_module

WORLD, TOL = 2, 1e-5
BASE = dict(batch_size=4, eval_sizes=[6, 3])
W2 = dict(workers=2, start='fork')
SPAWN = dict(W2, start='spawn')
FORKSERVER = dict(W2, start='forkserver')
PERSISTENT = dict(persistent=True, prefetch=4)
HF_FILES, HF_EVAL_FILES = [7, 3, 3, 2], [4, 1, 2, 2]  # uneven 'files', their shards split over 2 ranks
# webdataset shard sizes: rank r reads shards r::2 (split_by_node), worker w of 2 the shards w::2 of those
WDS_SHORT_FIRST, WDS_SHORT_LAST = [1, 4, 2, 3, 1, 3], [4, 1, 3, 2, 3, 1]  # 4/10 and 10/4 samples
WDS_EVAL = [3, 2, 2, 1]  # 5/3

CASES: dict[str, dict] = {
    'map_exact_w0_shadow': dict(BASE, data='exact_sampler', sizes=[10, 5], resume_at=2),
    'map_uneven_w2_persistent_rebalance': dict(
        BASE, **W2, **PERSISTENT, data='uneven_sampler', sizes=[10, 5], mode='rebalance', resume_at=2
    ),
    'iter_nolen_w2_shadow_short_first': dict(BASE, **W2, data='iterable_nolen', sizes=[5, 10], max_duration='8ba'),
    'iter_exact_w0_rebalance': dict(BASE, data='iterable_exact', sizes=[10, 5], mode='rebalance', resume_at=2),
    'iter_under_w2_shadow': dict(BASE, **W2, data='iterable_under', sizes=[10, 5]),
    'iter_exact_w2_spawn_persistent_shadow': dict(BASE, **SPAWN, **PERSISTENT, data='iterable_exact', sizes=[10, 5]),
    'iter_nolen_w2_persistent_rebalance_empty_first': dict(
        BASE,
        **W2,
        **PERSISTENT,
        data='iterable_nolen',
        sizes=[0, 10],
        eval_sizes=[0, 6],
        mode='rebalance',
        max_duration='4ba',
    ),
    'iter_exact_w0_shadow_empty_last': dict(BASE, data='iterable_exact', sizes=[10, 0], eval_sizes=[5, 0]),
    'plain_state_w0_rebalance': dict(BASE, data='plain_state', sizes=[10, 5], mode='rebalance', resume_at=2),
    'hf_iterable_w0_shadow': dict(
        BASE, data='hf_iterable', sizes=HF_FILES, eval_sizes=HF_EVAL_FILES, resume_at=2, max_duration='6ba'
    ),
    'hf_generator_w2_shadow': dict(
        BASE, **W2, data='hf_generator', sizes=HF_FILES, eval_sizes=HF_EVAL_FILES, max_duration='6ba'
    ),
    'hf_map_w2_forkserver_persistent_rebalance': dict(
        BASE, **FORKSERVER, **PERSISTENT, data='hf_map', sizes=[10, 5], mode='rebalance'
    ),
    'hf_map_w0_shadow': dict(BASE, data='hf_map', sizes=[10, 5], resume_at=2),
    'streaming_w0_shadow': dict(BASE, data='streaming', sizes=[8, 8], eval_sizes=[4, 4], resume_at=2),
    'streaming_w2_rebalance': dict(BASE, **W2, data='streaming', sizes=[8, 8], eval_sizes=[4, 4], mode='rebalance'),
    # replayed on resumption (Composer spins the epoch): with workers its state_dict() stays in their copies;
    # rebalancing without len() reads ahead into buffers no checkpoint holds
    'hf_iterable_w2_resume': dict(
        BASE, **W2, data='hf_iterable', sizes=HF_FILES, eval_sizes=HF_EVAL_FILES, resume_at=2, max_duration='6ba'
    ),
    'hf_iterable_w0_rebalance_resume': dict(
        BASE,
        data='hf_iterable',
        sizes=HF_FILES,
        eval_sizes=HF_EVAL_FILES,
        mode='rebalance',
        resume_at=2,
        max_duration='6ba',
    ),
    # webdataset: tar shards, split_by_node gives rank r the shards r::2 (the sizes of the shards, in order)
    'wds_w0_shadow_short_first': dict(
        BASE, data='wds', sizes=WDS_SHORT_FIRST, eval_sizes=WDS_EVAL, resume_at=2, max_duration='6ba'
    ),
    'wds_w2_rebalance': dict(
        BASE, **W2, data='wds', sizes=WDS_SHORT_LAST, eval_sizes=WDS_EVAL, mode='rebalance', max_duration='6ba'
    ),
    'wds_webloader_w2_shadow': dict(
        BASE, **W2, loader='webloader', data='wds', sizes=WDS_SHORT_LAST, eval_sizes=WDS_EVAL, max_duration='6ba'
    ),
    # torchdata's StatefulDataLoader (Composer ignores its state_dict: it resumes by spinning)
    'sdl_map_uneven_w2_shadow_short_first': dict(
        BASE, **W2, loader='stateful', data='uneven_sampler', sizes=[5, 10], resume_at=(2, 'ep1')
    ),
    'sdl_iter_exact_w0_rebalance': dict(
        BASE, loader='stateful', data='iterable_exact', sizes=[10, 5], mode='rebalance', resume_at=(2, 'epoch_end')
    ),
    # litdata: optimize()d into a local folder; it splits the samples over the ranks itself (drop_last=False)
    'litdata_sdl_w2_shadow': dict(
        BASE, **W2, loader='litdata', data='litdata', sizes=[15], eval_sizes=[9], resume_at=2
    ),
    'litdata_torch_w0_rebalance': dict(
        BASE, data='litdata', sizes=[9], eval_sizes=[9], mode='rebalance', resume_at='epoch_end'
    ),
    # Hugging Face: split_dataset_by_node, a data-dependent filter, a shuffle buffer (seed 0: 6/4 rows, seed 2: 4/6)
    'hf_filter_shuffle_w0_shadow': dict(
        BASE, data='hf_filter', seed=0, sizes=[16], eval_sizes=[10], resume_at=(1, 'epoch_end'), max_duration='4ba'
    ),
    'hf_filter_shuffle_w2_rebalance_short_first': dict(
        BASE,
        **W2,
        data='hf_filter',
        seed=2,
        sizes=[16],
        eval_sizes=[10],
        mode='rebalance',
        resume_at='ep1',
        max_duration='4ba',
    ),
    'hf_read_before_fit_w0_shadow': dict(
        BASE,
        data='hf_filter',
        read_before='next',
        seed=0,
        sizes=[16],
        eval_sizes=[10],
        resume_at='ep1',
        max_duration='4ba',
    ),
    'hf_count_before_fit_w0_rebalance_short_first': dict(
        BASE,
        data='hf_filter',
        read_before='count',
        seed=2,
        sizes=[16],
        eval_sizes=[10],
        mode='rebalance',
        resume_at='ep1',
        max_duration='4ba',
    ),
}
REFUSED: dict[str, tuple[dict, str]] = {  # case -> (cfg, what the error must advise)
    # webdataset's with_length(n) with the whole dataset's n on every rank: a len() that overcounts
    'wds_len_high_w0_shadow': (
        dict(BASE, data='wds_len_high', sizes=WDS_SHORT_LAST, eval_sizes=WDS_EVAL, pickles=False),
        'remove __len__',
    ),
    # rebalancing plans every batch from the len()s: one that undercounts stops every rank (docs/rebalancing.md)
    'iter_under_w2_rebalance_short_first': (
        dict(BASE, **W2, data='iterable_under', sizes=[5, 10], mode='rebalance'),
        "use mode='shadow'",
    ),
}


ALL = {**CASES, **{name: cfg for name, (cfg, _) in REFUSED.items()}}


def stock_key(cfg: dict) -> str:
    """What stock Composer's run depends on: the row without its mode (stock Composer has none)."""
    return repr(sorted((k, v) for k, v in cfg.items() if k != 'mode'))


STOCK: dict[str, str] = {}  # one stock run per pipeline (key): the first row's
for _name, _cfg in ALL.items():
    STOCK.setdefault(stock_key(_cfg), _name)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Whether each rank holds the fork guard, every case (the refused ones too), then stock Composer on each
    pipeline: one 2-rank launch."""
    folder = str(tmp_path_factory.mktemp('pipelines'))
    calls = [
        (name, 'scenarios_pipelines:run_case', dict(name=name, cfg=cfg, folder=folder)) for name, cfg in ALL.items()
    ]
    calls += [
        (f'stock:{name}', 'scenarios_pipelines:run_stock', dict(name=name, cfg=ALL[name], folder=folder))
        for name in STOCK.values()
    ]
    calls.insert(0, ('fork_guard', 'fork_guard:installed', {}))
    return launch(WORLD, calls, timeout=600)


def test_every_rank_holds_the_fork_guard_where_the_interpreter_needs_it(runs):
    """Every rank forks its DataLoader workers under ``tests/fork_guard.py`` on CPython 3.11, else not."""
    assert runs['fork_guard'] == [fork_guard.needed()] * WORLD


def steps_of(steps_per_rank: list[dict[int, tuple[int, list[int]]]]) -> list[list[list[int]]]:
    """Every recorded step, in order: the ids of each rank."""
    return [[steps[step][1] for steps in steps_per_rank] for step in sorted(steps_per_rank[0])]


def evaluated(flat: torch.Tensor, ids: list[int]) -> dict[str, float]:
    module = make_module('mlp')
    torch.nn.utils.vector_to_parameters(flat, module.parameters())
    with torch.no_grad():
        out = module(X[ids])
    return {
        'MulticlassAccuracy': float((out.argmax(1) == Y[ids]).float().mean()),
        'MeanLoss': float(torch.nn.functional.cross_entropy(out, Y[ids])),
    }


def expected_ids(cfg: dict, first: int, sizes: list[int]) -> list[int]:
    """The ids a row's data holds, from ``first``: all of them, or those its filter keeps."""
    ids = range(first, first + sum(sizes))
    return [i for i in ids if kept(i)] if cfg.get('data') == 'hf_filter' else list(ids)


def per_epoch(per_rank: list[dict]) -> dict[int, list[int]]:
    """Every id trained in each epoch, over all ranks, sorted."""
    out: dict[int, list[int]] = {}
    for res in per_rank:
        for epoch, ids in res['steps'].values():
            out.setdefault(epoch, []).extend(ids)
    return {e: sorted(ids) for e, ids in out.items()}


@pytest.mark.parametrize('name', list(CASES))
def test_pipeline_case_is_exact(runs, name):
    check_exact(name, CASES[name], ok(runs, name))


def check_exact(name: str, cfg: dict, results: list[dict]) -> None:
    """What every case must show (the module docstring), from its per-rank ``results`` (:func:`run_case`'s)."""
    full = [r['full'] for r in results]
    train_ids, eval_ids = expected_ids(cfg, 0, cfg['sizes']), expected_ids(cfg, EVAL_IDS, cfg['eval_sizes'])
    epochs = per_epoch(full)  # 2 or more (max_duration in batches without len())
    assert len(epochs) >= 2 and all(ids == train_ids for ids in epochs.values()), f'{name}: not every id once per epoch'
    for rank, res in enumerate(full):
        assert max_abs_diff(res['params'], full[0]['params']) == 0.0, f'{name}: rank {rank} differs from rank 0'
    diff = max_abs_diff(full[0]['params'], replay(steps_of([r['steps'] for r in full])))
    assert diff < TOL, f'{name}: {diff:.2e} from the single-process replay'
    for res in full:
        evaluations = len(epochs)  # one after each epoch
        assert len(res['eval_params']) == evaluations and all(len(v) == evaluations for v in res['eval'].values())
        for i, flat in enumerate(full[0]['eval_params']):
            expected = evaluated(flat, eval_ids)
            for metric, value in expected.items():
                assert res['eval'][metric][i] == pytest.approx(value, abs=1e-6), (name, i, metric)
    assert sorted(i for res in full for i in res['predicted']) == eval_ids
    assert sum(res['predicted_rows'] for res in full) == len(eval_ids)
    if cfg['data'] == 'iterable_under':  # predict() over a len() that undercounts: some rank yields more batches
        assert any(res['predict_batches'] > res['predict_len'] for res in full), [
            (res['predict_batches'], res['predict_len']) for res in full
        ]
    for rank, res in enumerate(results):
        for run in res.values():
            before, after = run['user_objects']
            assert before == after, f'{name}: rank {rank} changed the user objects: {before} -> {after}'
            pickled, still = run['pickles']  # before fit() and after it
            if cfg['data'] != 'streaming':  # its dataset keeps its reader threads (a Lock) once read, stock too
                assert still == pickled, f'{name}: rank {rank}: pickles {pickled} before fit(), {still} after'
            if cfg.get('pickles', True):  # False: the user's dataset does not pickle to begin with
                assert pickled == {'dataset': True, 'sampler': True}, pickled
    from scenarios_pipelines import resume_positions  # imports Composer: only when a case is checked

    positions = resume_positions(cfg)
    assert sorted(results[0]) == sorted(['full'] + [f'resumed@{at}' for at in positions]), sorted(results[0])
    for at in positions:
        for rank, res in enumerate(results):
            resumed = res[f'resumed@{at}']
            k = resumed['resumed_from']
            assert (
                k == at if isinstance(at, int) else k == 1 + max(s for s, (e, _) in full[0]['steps'].items() if e == 0)
            )
            later = {s: v for s, v in res['full']['steps'].items() if s >= k}
            assert resumed['steps'] == later, f'{name}: rank {rank} resumed @{at} different steps'
            diff = max_abs_diff(resumed['params'], res['full']['params'])
            assert diff < 1e-6, f'{name}: rank {rank} resumed @{at} {diff:.2e} from the uninterrupted run'


# the adapter chosen by what the data is (composer_join.data.positions), for a row of each kind
POSITIONS = {
    'sdl_map_uneven_w2_shadow_short_first': 'LoaderPosition',  # torchdata's StatefulDataLoader
    'sdl_iter_exact_w0_rebalance': 'LoaderPosition',
    'litdata_sdl_w2_shadow': 'LoaderPosition',  # litdata's StreamingDataLoader
    'litdata_torch_w0_rebalance': 'LitDataPosition',  # litdata's StreamingDataset in a torch DataLoader
    'hf_iterable_w0_shadow': 'HuggingFacePosition',
    'hf_read_before_fit_w0_shadow': 'Replay',  # a shuffle buffer
    'hf_iterable_w2_resume': 'Replay',  # DataLoader workers
    'hf_iterable_w0_rebalance_resume': 'Replay',  # rebalancing without len()
    'plain_state_w0_rebalance': 'PlainStatePosition',  # registered by the tests
    'streaming_w0_shadow': None,  # mosaicml-streaming: left to Composer
    'map_exact_w0_shadow': 'GlobalOrderPosition',  # no state of its own: its sampler's global order
}


@pytest.mark.parametrize('name', list(POSITIONS))
def test_the_position_adapter_is_chosen_by_what_the_data_is(runs, name):
    for rank, res in enumerate(ok(runs, name)):
        assert res['full']['position'] == POSITIONS[name], (name, rank, res['full']['position'])


@pytest.mark.parametrize('name', list(REFUSED))
def test_refused_pipeline_stops_every_rank_with_advice(runs, name):
    # every rank stops; the ranks whose own data is refused say what to use instead, the others name those ranks
    advice = REFUSED[name][1]
    for rank, res in enumerate(runs[name]):
        assert isinstance(res, RankError), f'{name}: rank {rank} did not stop: {type(res).__name__}'
        assert res.type == 'UnevenInputsError', f'rank {rank}: {res}'
    advised = [rank for rank, res in enumerate(runs[name]) if advice in res.message]
    assert advised, f'{name}: no rank advises {advice!r}'
    for rank, res in enumerate(runs[name]):
        assert rank in advised or f'rank(s) {advised}' in res.message, f'rank {rank}: {res}'


def test_the_user_objects_check_sees_a_replaced_method():
    # the check the matrix applies to the user's objects fails where an attribute is set on one
    from torch.utils.data import DataLoader

    from pipeline_data import PlainState, collate_ids
    from scenarios_pipelines import pickles, user_objects

    loader = DataLoader(PlainState([1, 2], 2), batch_size=2, collate_fn=collate_ids)
    before = user_objects(loader)
    loader.dataset.state_dict = lambda *a: {}  # what 0.1.0 did to a dataset with state_dict
    assert user_objects(loader) != before
    assert pickles(loader)['dataset'] is not True


DOCS = Path(__file__).parent.parent / 'docs' / 'data-pipelines.md'
STOCK_COLUMN = 'stock Composer (measured)'


def stock_outcome(cfg: dict, per_rank: list[dict]) -> str:
    """What stock Composer did on a pipeline, in the words of the docs' column: the train ids of the first epoch
    trained (over all ranks, of the epoch's), then the eval ids evaluated, or the error and the batch it came after."""
    trained = [i for res in per_rank for epoch, ids in res['steps'].values() if epoch == 0 for i in ids]
    evaluated = [i for res in per_rank for i in res['evaluated']]

    def counted(ids: list[int], total: int) -> str:
        twice = len(ids) - len(set(ids))
        return f'{len(set(ids))} of {total}' + (f' ({twice} more than once)' if twice else '')

    parts = [f'trains {counted(trained, len(expected_ids(cfg, 0, cfg["sizes"])))}']
    errors = sorted({res['error'][0] + ': ' + res['error'][1].splitlines()[0] for res in per_rank if res['error']})
    if errors:
        raised = [rank for rank, res in enumerate(per_rank) if res['error']]
        who = '' if len(raised) == len(per_rank) else f'rank(s) {raised} '
        after = max(len(res['steps']) for res in per_rank)
        parts.append(f'{who}raises `{" / ".join(errors)}` after batch {after}')
    else:
        parts.append(f'evaluates {counted(evaluated, len(expected_ids(cfg, EVAL_IDS, cfg["eval_sizes"])))}')
    return ', '.join(parts)


def docs_column(text: str, column: str) -> dict[str, str]:
    """``{case: cell}`` of every markdown table of ``text`` with a ``column``, its first cell a case name in backticks."""
    out: dict[str, str] = {}
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith('|'):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if not header:
            header = cells
        elif column in header and not set(line) <= set('|-: '):
            out[cells[0].strip('`')] = cells[header.index(column)]
    return out


def test_docs_stock_column_is_the_measured_one(runs):
    # the docs' stock column, row by row, is what stock Composer did on that row's pipeline in this launch
    measured = {}
    for name, cfg in ALL.items():
        measured[name] = stock_outcome(cfg, ok(runs, f'stock:{STOCK[stock_key(cfg)]}'))  # its errors are in it
    documented = docs_column(DOCS.read_text(), STOCK_COLUMN)
    wrong = {name: (documented.get(name), text) for name, text in measured.items() if documented.get(name) != text}
    assert not wrong, 'docs/data-pipelines.md disagrees (documented, measured):\n' + '\n'.join(
        f'{name}: {doc!r} != {text!r}' for name, (doc, text) in wrong.items()
    )


def test_the_docs_column_reader_and_the_stock_wording():
    # the reader finds a table's column by its header, and the wording counts ids, repeats and errors
    text = '| case | x | stock Composer (measured) |\n|---|---|---|\n| `a` | 1 | trains 1 of 2 |\n\n| case | y |\n|---|---|\n| `b` | 2 |'
    assert docs_column(text, STOCK_COLUMN) == {'a': 'trains 1 of 2'}
    cfg = dict(sizes=[2, 1], eval_sizes=[1, 1])
    ok_rank = {'steps': {0: (0, [0, 1])}, 'evaluated': [500], 'error': None}
    assert stock_outcome(cfg, [ok_rank, dict(ok_rank, steps={0: (0, [1])})]) == (
        'trains 2 of 3 (1 more than once), evaluates 1 of 2 (1 more than once)'
    )
    failed = dict(ok_rank, error=('TypeError', 'bad\nmore'))
    assert stock_outcome(cfg, [failed, dict(ok_rank, steps={0: (0, [2]), 1: (0, [])})]) == (
        'trains 3 of 3, rank(s) [0] raises `TypeError: bad` after batch 2'
    )


def test_the_workers_data_module_imports_neither_composer_nor_the_harness():
    # spawn and forkserver workers import tests/pipeline_data.py to unpickle the dataset: each worker start pays
    # for what it imports (torch's ~3 s of CPU is the floor; Composer would add ~8 s)
    code = (
        'import sys; import pipeline_data; '
        "heavy = sorted(m for m in ('composer', 'composer_join', 'harness', 'rank_scenarios', 'datasets', 'streaming', "
        "'webdataset', 'litdata', 'torchdata') "
        'if m in sys.modules); print(heavy)'
    )
    out = subprocess.run(
        [sys.executable, '-c', code], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '[]', out.stdout
