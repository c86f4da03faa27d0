"""Every private name of torch, Composer, torchmetrics and Hugging Face ``datasets`` that composer-join uses.

Nothing private is imported when the package loads: each function here looks its names up when called, and a
name missing from the installed version raises :class:`CompatError` naming it, the package and its installed
version, and the versions composer-join was tested with (:data:`TESTED`); where a path does without it, that
path is taken instead (noted per function). :func:`missing` lists what the installed versions lack, for the
suite to check once.

=======================  ============================================================================
package                  private names (what for)
=======================  ============================================================================
torch DDP                ``_BufferCommHookLocation``, ``_register_buffer_comm_hook`` (buffers broadcast
                         from a rank with data), ``_default_broadcast_coalesced``,
                         ``_assign_modules_buffers`` (buffers equal on every rank); for the inert shadow
                         microbatch (without them: the template way): ``_build_params_for_reducer``,
                         ``_check_sync_bufs_pre_fwd``, ``_check_sync_bufs_post_fwd``, ``_sync_buffers``,
                         the reducer's ``_rebuild_buckets``, ``_get_zeros_like_grad_buckets``,
                         ``_run_comm_hook``, ``_get_local_used_map``, ``_push_all_rebuilt_params``,
                         ``_reset_state`` (after a retried step), DDP's ``_has_rebuilt_buckets`` (the
                         stand-in's buckets kept per layout; without it: made anew each time);
                         ``_use_python_reducer``,
                         ``_delay_all_reduce_all_params`` (configurations the stand-in does not cover)
torch FSDP               FSDP1 ``_handle.flat_param`` and its ``_fqns``, ``_param_infos``,
                         ``_shared_param_infos``; FSDP2 ``_get_fsdp_state()``,
                         ``_fsdp_param_group``, ``_param_fqn``, ``_unsharded_param`` (gradient units)
torch.distributed        ``_broadcast_coalesced`` (counted by ``CollectiveCounter``)
torch schedulers         ``LRScheduler._last_lr`` (``get_last_lr()`` after a schedule's rate is set again)
torch process groups     ``_device_types``, ``wrapped_pg``, ``options._timeout`` (the transfer group's
                         timeout; without them: torch's default)
Composer                 ``composer.core.data_spec._default_split_batch``,
                         ``DataSpec._default_get_num_samples_in_batch`` (counting as Composer counts),
                         ``composer.trainer.trainer._get_distributed_sampler`` (reshuffling as Composer
                         does), ``State._dataloader_len`` (lifting the length cap), ``State._dataset_of``,
                         ``composer.core.engine._get_default_passes`` (the algorithm pass),
                         ``Trainer._train_data_spec``, ``Trainer._ddp_sync_strategy`` and
                         ``Trainer.spin_dataloaders`` (found on the call stack, ``sys._getframe``; without
                         the strategy: every step is watched; without the spin setting: Composer's default),
                         ``Trainer.predict``'s local ``data_spec`` (the same way; without it: Composer's
                         default ``DataSpec``)
torchmetrics             ``Metric._defaults``, ``_reductions``, ``_update_count``, ``_computed``
Hugging Face datasets    ``IterableDataset._ex_iterable`` (a shuffle buffer; without it: assumed)
=======================  ============================================================================
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NamedTuple, Optional

from composer_join.core.errors import UnevenInputsError

__all__ = [
    'DDP_BROADCAST',
    'TESTED',
    'CompatError',
    'TrainView',
    'assign_ddp_buffers',
    'broadcast_ddp_buffers',
    'buckets_rebuilt',
    'calling_state',
    'dataloader_cap_off',
    'ddp_sync_strategy',
    'default_count',
    'default_passes',
    'default_split_batch',
    'distributed_sampler',
    'fsdp1_flat_param',
    'fsdp1_modules',
    'fsdp2_params',
    'group_timeout',
    'hf_shuffle_buffer',
    'local_used_map',
    'metric_list_states',
    'metric_reduction',
    'metric_state_names',
    'missing',
    'params_for_reducer',
    'predict_data_spec',
    'private',
    'push_rebuilt_params',
    'rebuild_buckets',
    'register_buffer_hook',
    'reset_reducer',
    'run_comm_hook',
    'set_default_passes',
    'set_last_lr',
    'set_update_count',
    'sparse_grad_params',
    'sparse_params',
    'stand_in_unsupported',
    'static_graph_first_pending',
    'sync_buffers_around_forward',
    'train_view',
    'transforms_batches',
    'update_count',
    'zero_grad_buckets',
]

DDP_BROADCAST = '_broadcast_coalesced'
"""``torch.distributed``'s private broadcast DDP uses for buffers (counted by :class:`~composer_join.CollectiveCounter`)."""

TESTED = 'torch 2.6.0-2.7.0, mosaicml (Composer) 0.32.1, torchmetrics 1.7.x, datasets 3.3-3.6'
"""The versions every name here was checked with (the suite; docs/compatibility.md)."""


class CompatError(UnevenInputsError):
    """A private name composer-join needs is missing from the installed version of its package."""


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({'composer': 'mosaicml'}.get(package, package))
    except PackageNotFoundError:
        return 'unknown'


def private(owner: Any, name: str, package: str) -> Any:
    """``owner.name`` (an object's or a module's, given by its dotted path as a string), or :class:`CompatError`."""
    target = importlib.import_module(owner) if isinstance(owner, str) else owner
    try:
        return getattr(target, name)
    except AttributeError:
        where = owner if isinstance(owner, str) else type(owner).__qualname__
        raise CompatError(
            f"composer-join needs {package} {_version(package)}'s private {where}.{name}, which this version does "
            f'not have (tested with {TESTED}); install a tested version.'
        ) from None


def _has(owner: Any, name: str) -> bool:
    try:
        private(owner, name, '')
    except (CompatError, ImportError):
        return False
    return True


# -- torch: DistributedDataParallel ------------------------------------------------------------------------------

_STAND_IN = ('_build_params_for_reducer', '_check_sync_bufs_pre_fwd', '_check_sync_bufs_post_fwd', '_sync_buffers')
_REDUCER = (
    '_rebuild_buckets',
    '_get_zeros_like_grad_buckets',
    '_run_comm_hook',
    '_get_local_used_map',
    '_push_all_rebuilt_params',
)


def register_buffer_hook(ddp: Any, hook: Callable[[Any, dict[str, Any]], None]) -> None:
    """Run ``hook(state, named_buffers)`` where DDP would broadcast the buffers before a synced forward."""
    location = private('torch.nn.parallel.distributed', '_BufferCommHookLocation', 'torch')
    private(ddp, '_register_buffer_comm_hook', 'torch')(None, hook, comm_hook_location=location.PRE_FORWARD)


def broadcast_ddp_buffers(ddp: Any, source: int, buffers: Optional[list[Any]] = None) -> None:
    """DDP's own coalesced broadcast of its buffers (``buffers``: these), from rank ``source``."""
    broadcast = private(ddp, '_default_broadcast_coalesced', 'torch')
    if buffers is None:
        broadcast(authoritative_rank=source)
    else:
        broadcast(bufs=buffers, authoritative_rank=source)


def assign_ddp_buffers(ddp: Any) -> None:
    """DDP's list of buffers to broadcast, made again (a forward may have replaced some)."""
    private(ddp, '_assign_modules_buffers', 'torch')()


def stand_in_unsupported(ddp: Any) -> Optional[str]:
    """Why DDP's collectives cannot be issued without the model here (its configuration, or a missing name), or None."""
    if getattr(ddp, '_use_python_reducer', False) or getattr(ddp, '_delay_all_reduce_all_params', False):
        return 'DDP runs with a compiled or python reducer, or delayed all-reduces'
    names = [n for n in _STAND_IN if not _has(ddp, n)]
    reducer_ = getattr(ddp, 'reducer', None)
    names += [f'reducer.{n}' for n in _REDUCER if reducer_ is not None and not _has(reducer_, n)]
    return f'torch {_version("torch")} lacks DDP internals {names} (tested with {TESTED})' if names else None


def sync_buffers_around_forward(ddp: Any) -> None:
    """What DDP's forward does with buffers besides running the module: its pre- and post-forward syncs."""
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()
    if ddp._check_sync_bufs_post_fwd():
        ddp._sync_buffers()


def params_for_reducer(ddp: Any) -> list[Any]:
    """The parameters in the order of DDP's reducer (its used-parameter map's order)."""
    return private(ddp, '_build_params_for_reducer', 'torch')()[0]


def sparse_params(ddp: Any) -> bool:
    """Whether some module of ``ddp`` produces sparse gradients."""
    return bool(sparse_grad_params(ddp))


def sparse_grad_params(ddp: Any) -> list[Any]:
    """The parameters of ``ddp`` whose gradients are sparse (an ``nn.Embedding(sparse=True)``'s weight), as DDP finds
    them."""
    if not _has(ddp, '_build_params_for_reducer'):  # another torch: the template way without this refinement
        return []
    params, sparse = private(ddp, '_build_params_for_reducer', 'torch')()
    return [p for p, is_sparse in zip(params, sparse) if is_sparse]


def rebuild_buckets(ddp: Any) -> bool:
    """The reducer's bucket rebuild (a broadcast, once per training), where DDP's forward does it; whether it rebuilt
    (the buckets' layout changed)."""
    return bool(private(ddp.reducer, '_rebuild_buckets', 'torch')())


def buckets_rebuilt(ddp: Any) -> Optional[bool]:
    """Whether DDP's own forward has rebuilt the reducer's buckets (``_has_rebuilt_buckets``; put back to False when
    its process group changes), or None where the installed torch does not show it (then assume any layout)."""
    value = getattr(ddp, '_has_rebuilt_buckets', None)
    return value if isinstance(value, bool) else None


def zero_grad_buckets(ddp: Any) -> list[Any]:
    """The reducer's gradient buckets, filled with zeros (this rank's contribution when it used nothing)."""
    return private(ddp.reducer, '_get_zeros_like_grad_buckets', 'torch')()


def run_comm_hook(ddp: Any, bucket: Any) -> Any:
    """The reducer's communication hook on ``bucket`` (an all-reduce, by default): a future."""
    return private(ddp.reducer, '_run_comm_hook', 'torch')(bucket)


def local_used_map(ddp: Any) -> Any:
    """The reducer's map of the parameters this rank used (``find_unused_parameters``)."""
    return private(ddp.reducer, '_get_local_used_map', 'torch')()


def push_rebuilt_params(ddp: Any) -> None:
    """Tell the reducer its buckets were rebuilt as a backward would."""
    private(ddp.reducer, '_push_all_rebuilt_params', 'torch')()


def static_graph_first_pending(ddp: Any) -> bool:
    """Whether a ``static_graph`` DDP has not run its first synced backward yet (torch's
    ``_static_graph_delay_allreduce_enqueued``, set by that backward); False if the name is missing."""
    return getattr(ddp, '_static_graph_delay_allreduce_enqueued', True) is False


def reset_reducer(ddp: Any) -> None:
    """The reducer's own reset (what DDP does when its process group changes); nothing if it has none."""
    reset = getattr(getattr(ddp, 'reducer', None), '_reset_state', None)
    if reset is not None:
        reset()


def group_timeout(group: Any) -> Any:
    """A process group's collective timeout (a ``timedelta``); None, torch's default for a new group, where the
    installed torch does not show it (the path without the names)."""
    try:
        backend = group._get_backend(group._device_types[0])
        backend = getattr(backend, 'wrapped_pg', backend)  # under TORCH_DISTRIBUTED_DEBUG=DETAIL, a checking wrapper
        return backend.options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None


# -- torch: FSDP -----------------------------------------------------------------------------------------------


def fsdp1_flat_param(module: Any) -> Optional[tuple[str, Any]]:
    """An FSDP1 instance's flat parameter and the names of what it holds, or None if it holds none."""
    handle = private(module, '_handle', 'torch')
    if handle is None:
        return None
    flat = handle.flat_param
    return ', '.join(private(flat, '_fqns', 'torch')), flat


def fsdp1_modules(flat: Any) -> list[Any]:
    """The modules whose own parameters an FSDP1 flat parameter holds (a shared parameter's every module)."""
    infos = [*private(flat, '_param_infos', 'torch'), *private(flat, '_shared_param_infos', 'torch')]
    return [info.module for info in infos]


def fsdp2_params(module: Any) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """An FSDP2 module's parameters: ``(sharded parameter, its name, () -> its unsharded parameter or None)``."""
    group = private(private(module, '_get_fsdp_state', 'torch')(), '_fsdp_param_group', 'torch')
    if group is None:
        return
    for fsdp_param in group.fsdp_params:
        yield fsdp_param.sharded_param, private(fsdp_param, '_param_fqn', 'torch'), _unsharded(fsdp_param)


def _unsharded(fsdp_param: Any) -> Callable[[], Any]:
    return lambda: getattr(fsdp_param, '_unsharded_param', None)


# -- Composer --------------------------------------------------------------------------------------------------


def default_split_batch() -> Callable[[Any, Any], Any]:
    """Composer's default ``DataSpec.split_batch``."""
    return private('composer.core.data_spec', '_default_split_batch', 'composer')


def transforms_batches(spec: Any) -> bool:
    """Whether ``spec.batch_transforms`` is one of the user's, not Composer's no-op default
    (``DataSpec._default_transforms``, a method: compared by its function)."""
    from composer.core import DataSpec

    default = private(DataSpec, '_default_transforms', 'composer')
    return getattr(spec.batch_transforms, '__func__', None) is not default


def predict_data_spec(state: Any) -> Any:
    """The ``DataSpec`` of the ``Trainer.predict()`` call running for ``state`` (its local ``data_spec``: Composer
    keeps it nowhere else), found on the call stack from inside one of its events; None if not found."""
    from composer.core import DataSpec

    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get('self')
        if frame.f_code.co_name == 'predict' and getattr(owner, 'state', None) is state:
            spec = frame.f_locals.get('data_spec')
            return spec if isinstance(spec, DataSpec) else None
        frame = frame.f_back
    return None


def default_count(batch: Any) -> float:
    """Samples in ``batch`` as Composer's default ``DataSpec`` counts them."""
    from composer.core import DataSpec

    return private(DataSpec, '_default_get_num_samples_in_batch', 'composer')(None, batch)


def distributed_sampler(dataloader: Any) -> Any:
    """The ``DistributedSampler`` Composer finds in a ``DataLoader`` (``batch_sampler`` first), or None."""
    return private('composer.trainer.trainer', '_get_distributed_sampler', 'composer')(dataloader)


def dataloader_cap_off(state: Any) -> None:
    """No ``dataloader_len`` cap for Composer's next loop (its setter would read ``len()`` back)."""
    private(state, '_dataloader_len', 'composer')
    state._dataloader_len = None


def set_last_lr(scheduler: Any, rates: list[Any]) -> None:
    """A torch scheduler's record of the learning rates it set last (``get_last_lr()``), as its ``step()`` keeps it."""
    private(scheduler, '_last_lr', 'torch')
    scheduler._last_lr = rates


def _dataset_of(state: Any, dataloader: Any) -> Any:
    """The dataset Composer reaches through ``dataloader`` (a ``DataLoader``'s), or None."""
    return private(state, '_dataset_of', 'composer')(dataloader)


def default_passes() -> Callable[[], list]:
    """Composer's function giving the algorithm passes of every new Engine."""
    return private('composer.core.engine', '_get_default_passes', 'composer')


def set_default_passes(passes: Callable[[], list]) -> None:
    """Replace :func:`default_passes` (for every Engine created afterwards)."""
    from composer.core import engine

    default_passes()
    engine._get_default_passes = passes


def _on_trainer(state: Any, name: str, kind: Any = object) -> Any:
    """Attribute ``name`` of the running ``Trainer`` whose ``state`` is ``state``, found on the call stack from inside
    one of its events (algorithms are not given the ``Trainer``); None if not found or not a ``kind``."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get('self')
        if getattr(owner, 'state', None) is state:
            value = getattr(owner, name, None)
            if isinstance(value, kind):
                return value
        frame = frame.f_back
    return None


def calling_state() -> Any:
    """The Composer ``State`` whose method is calling, found on the call stack: Composer's ``State.state_dict`` and
    ``State.load_state_dict`` call each algorithm's, and do not say for which trainer. None if no ``State`` is."""
    from composer.core import State

    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get('self')
        if isinstance(owner, State):
            return owner
        frame = frame.f_back
    return None


class TrainView(NamedTuple):
    """What Composer holds of a fit's train data that an algorithm is not given (:func:`train_view`)."""

    spec: Any
    """The ``DataSpec`` the running ``Trainer`` counts, transforms and splits train batches with
    (``Trainer._train_data_spec``); None if not found."""
    spins: bool
    """Whether it skips a resumed epoch's first ``batch_in_epoch`` batches by reading them again
    (``Trainer.spin_dataloaders``, Composer's default True; True if not found)."""
    dataset: Any
    """The dataset Composer reaches through ``state.train_dataloader`` (``State._dataset_of``), or None."""
    transforms: bool
    """:attr:`spec` has a ``batch_transforms`` of the user's (not Composer's no-op): what Composer counts and trains
    is then the transformed batch, which may hold other samples than the dataloader yielded."""


def train_view(state: Any) -> TrainView:
    """Composer's view of the train data of the fit starting for ``state``, read once, at ``FIT_START``, by the fit's
    session (every other part is handed it). The ``Trainer``'s settings are found on the call stack: algorithms are not
    given the ``Trainer``, so this looks for the one whose ``state`` is ``state``. Cost: two walks up the stack (a few dozen frames)."""
    from composer.core import DataSpec

    spec, spins = _on_trainer(state, '_train_data_spec', DataSpec), _on_trainer(state, 'spin_dataloaders', bool)
    dataset = _dataset_of(state, state.train_dataloader)
    return TrainView(spec, True if spins is None else spins, dataset, spec is not None and transforms_batches(spec))


def ddp_sync_strategy(state: Any) -> Optional[str]:
    """The running ``Trainer``'s ``ddp_sync_strategy`` (``'single_auto_sync'``, ``'multi_auto_sync'`` or
    ``'forced_sync'``: Composer resolves its default in ``Trainer.__init__`` and keeps it as ``_ddp_sync_strategy``),
    found like :func:`train_view`; None if not found."""
    from composer.distributed import DDPSyncStrategy

    strategy = _on_trainer(state, '_ddp_sync_strategy', DDPSyncStrategy)
    return None if strategy is None else str(strategy.value)


# -- torchmetrics ----------------------------------------------------------------------------------------------


def metric_list_states(metric: Any) -> list[str]:
    """The metric's states whose default is a list (``cat`` states)."""
    return [a for a, d in private(metric, '_defaults', 'torchmetrics').items() if isinstance(d, list)]


def metric_reduction(metric: Any, state: str) -> Any:
    """The function that reduces ``state`` across ranks (``dim_zero_cat``, None, ...)."""
    return private(metric, '_reductions', 'torchmetrics').get(state)


def metric_state_names(metric: Any) -> list[str]:
    """Everything that holds a metric's accumulated state: its states, its update count, its cached value."""
    return list(getattr(metric, '_defaults', {})) + ['_update_count', '_computed']


def update_count(metric: Any) -> int:
    return private(metric, '_update_count', 'torchmetrics')


def set_update_count(metric: Any, count: int) -> None:
    private(metric, '_update_count', 'torchmetrics')
    metric._update_count = count


# -- Hugging Face datasets --------------------------------------------------------------------------------------


def hf_shuffle_buffer(dataset: Any) -> bool:
    """Whether a Hugging Face ``IterableDataset`` shuffles with a buffer (its ``state_dict()`` then loses it)."""
    root = getattr(dataset, '_ex_iterable', None)
    if root is None:
        return True
    stack, seen = [root], 0
    while stack and seen < 1000:  # a chain (map, filter, ...) or a tree (interleave, concatenate)
        node, seen = stack.pop(), seen + 1
        if type(node).__name__ == 'BufferShuffledExamplesIterable':
            return True
        stack.extend(child for child in [getattr(node, 'ex_iterable', None)] if child is not None)
        stack.extend(getattr(node, 'ex_iterables', None) or [])
    return False


def _reducer_class() -> Any:
    import torch.distributed as tdist

    return tdist.Reducer


# -- the check -------------------------------------------------------------------------------------------------


def missing() -> list[str]:
    """The private names above that the installed torch, Composer and torchmetrics lack (empty: all there)."""
    from composer.core import DataSpec, State
    from torch.nn.parallel import DistributedDataParallel

    found = []
    checks: list[tuple[Any, str]] = [
        ('torch.nn.parallel.distributed', '_BufferCommHookLocation'),
        ('torch.distributed', DDP_BROADCAST),
        *((DistributedDataParallel, n) for n in ('_register_buffer_comm_hook', '_default_broadcast_coalesced')),
        *((DistributedDataParallel, n) for n in ('_assign_modules_buffers', *_STAND_IN)),
        *((_reducer_class(), n) for n in (*_REDUCER, '_reset_state')),
        ('composer.core.data_spec', '_default_split_batch'),
        (DataSpec, '_default_get_num_samples_in_batch'),
        (DataSpec, '_default_transforms'),
        ('composer.trainer.trainer', '_get_distributed_sampler'),
        (State, '_dataset_of'),
        ('composer.core.engine', '_get_default_passes'),
    ]
    for owner, name in checks:
        if not _has(owner, name):
            found.append(f'{owner if isinstance(owner, str) else owner.__qualname__}.{name}')
    from torchmetrics.aggregation import SumMetric

    metric = SumMetric()
    found += [
        f'Metric.{n}' for n in ('_defaults', '_reductions', '_update_count', '_computed') if not hasattr(metric, n)
    ]
    return found
