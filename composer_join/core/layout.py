"""Which ranks are one data-parallel member: a tensor-parallel group trains one batch, so it joins as one.

Under tensor parallelism (TP) the ranks of a TP group hold slices of the same layers and run their forward and
backward together, on the *same* batch; only across TP groups is the data parallel. Under hybrid sharding (HSDP:
shard inside a node, replicate across nodes) every rank is its own data-parallel member. A :class:`Layout`
names the members: each is a tuple of global ranks (one rank, or a TP group in TP order).

Everything UnevenJoin decides per rank, it decides per member: the length agreement and every step's agreement
(:func:`check_lengths`, :meth:`Layout.check_rows`: the ranks of a member must hold the same batch, or every rank
stops with an :class:`~composer_join.core.errors.UnevenInputsError` naming the group, its ranks and what each
holds), the epoch report (:meth:`Layout.member_plan`, one count per member), and the rebalancing schedules,
computed over members and spread to ranks so that rank ``k`` of a receiving group gets its batch from rank ``k``
of the giving group (:meth:`Layout.on_ranks`). Under a flat layout (no TP) each of these is the identity.

Who calls what: :func:`trainer_layout` once per start event (the trainer's state: Composer's device mesh and
``tp_config``, public attributes of ``State``); the loader and the rebalancers get the layout when they are
built. Cost: nothing without TP; under TP, every step is agreed (one small all-reduce, overlapped with the
previous step) and each batch gets a CRC of its CPU tensors (:func:`~composer_join.core.batches.content_crc`).

Example:
    >>> layout = Layout(((0, 1), (2, 3)))  # TP 2 x 2 data-parallel members
    >>> layout.members, layout.tp, layout.member(3), layout.counterpart(0, 3)
    (2, 2, 1, 1)
    >>> layout.on_ranks([1, None], lambda owner, rank: layout.counterpart(owner, rank))
    [2, 3, None, None]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar

from composer.utils import ParallelismType, dist

from composer_join.core.errors import UnevenInputsError
from composer_join.core.plan import RankStatus, StepPlan

__all__ = ['Layout', 'check_lengths', 'trainer_layout']

T = TypeVar('T')
C = TypeVar('C')

_ADVICE = (
    'The ranks of a tensor-parallel group must be given the same batches at every step: shard the data over '
    "data-parallel ranks (ExactDistributedSampler does so by itself under UnevenJoin; torch's DistributedSampler "
    "needs num_replicas=<data-parallel size>, rank=<data-parallel rank>; mosaicml-streaming's StreamingDataset "
    'needs replication=<tensor-parallel degree>).'
)


@dataclass(frozen=True)
class Layout:
    """The data-parallel members of a run: ``groups[m]`` are the global ranks of member ``m``, in TP order.

    Every group has the same size (the TP degree), and together they hold every rank once.
    """

    groups: tuple[tuple[int, ...], ...]
    _member: dict[int, int] = field(init=False, repr=False, compare=False)  # rank -> member, from ``groups``

    def __post_init__(self) -> None:
        ranks = sorted(r for g in self.groups for r in g)
        if ranks != list(range(len(ranks))) or len({len(g) for g in self.groups}) != 1:
            raise ValueError(f'a layout holds every rank once, in groups of one size: {self.groups}')
        object.__setattr__(self, '_member', {r: m for m, g in enumerate(self.groups) for r in g})

    @classmethod
    def flat(cls, world_size: int) -> Layout:
        """Every rank its own member (DDP, FSDP, HSDP)."""
        return cls(tuple((r,) for r in range(world_size)))

    @property
    def tp_groups(self) -> Optional[tuple[tuple[int, ...], ...]]:
        """The groups where there is tensor parallelism, else None: what a checkpoint records and compares."""
        return self.groups if self.tp > 1 else None

    @property
    def world_size(self) -> int:
        return self.members * self.tp

    @property
    def members(self) -> int:
        """The data-parallel size."""
        return len(self.groups)

    @property
    def tp(self) -> int:
        """Ranks per member: the tensor-parallel degree (1: flat)."""
        return len(self.groups[0])

    def member(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank``."""
        return self._member[rank]

    def counterpart(self, member: int, rank: int) -> int:
        """The rank of member ``member`` in the same TP position as global rank ``rank``."""
        return self.groups[member][self.groups[self.member(rank)].index(rank)]

    def leaders(self, values: Sequence[T]) -> list[T]:
        """Per member, the value of its first rank (``values`` per global rank, the same within a member)."""
        return [values[g[0]] for g in self.groups]

    def on_ranks(self, cells: Sequence[Optional[C]], onto: Callable[[C, int], C]) -> list[Optional[C]]:
        """A row per member as a row per rank: each rank takes its member's cell, ``onto(cell, rank)`` (None stays)."""
        return [None if (c := cells[self.member(r)]) is None else onto(c, r) for r in range(self.world_size)]

    def member_plan(self, plan: StepPlan) -> StepPlan:
        """``plan`` with one status per member (its first rank's): what the report counts."""
        if self.tp == 1:
            return plan
        return replace(plan, statuses=tuple(self.leaders(plan.statuses)))

    def name(self, member: int) -> str:
        """How messages name member ``member``."""
        if self.tp == 1:
            return f'rank {member}'
        return f'data-parallel rank {member} (tensor-parallel group of ranks {list(self.groups[member])})'

    def check_rows(self, statuses: Sequence[RankStatus], step: int, epoch: int, label: str) -> None:
        """Raise, the same on every rank, if the ranks of a member hold different batches at a step.

        ``statuses``: every rank's agreed row. Compared: whether it has a batch, samples, microbatches, structure,
        contents (where both ranks could take a CRC) and the rebalancing columns. No collective.
        """
        if self.tp == 1:
            return
        for m, group in enumerate(self.groups):
            rows = [statuses[r] for r in group]
            contents = {s.content for s in rows}
            first = replace(rows[0], content=0, unreported_samples=0)
            same = all(replace(s, content=0, unreported_samples=0) == first for s in rows)
            if same and (len(contents) == 1 or 0 in contents):
                continue
            held = '; '.join(f'rank {r}: {_holds(s)}' for r, s in zip(group, rows))
            raise UnevenInputsError(
                f'the ranks of tensor-parallel group {m} (ranks {list(group)}) hold different {label} batches at '
                f'step {step} of epoch {epoch} ({held}). {_ADVICE}'
            )


def _holds(status: RankStatus) -> str:
    if status.failed:
        return 'its dataloader raised'
    if not status.has_batch:
        return 'no batch'
    crc = f', contents CRC {status.content:08x}' if status.content else ''
    return (
        f'a batch of {status.samples} samples in {status.microbatches} microbatch(es), structure '
        f'{status.structure:08x}{crc}'
    )


def check_lengths(layout: Layout, lengths: Sequence[Optional[int]], label: str) -> None:
    """Raise, the same on every rank, if the ranks of a member have different ``len()`` (``lengths``, per rank)."""
    for m, group in enumerate(layout.groups):
        own = [lengths[r] for r in group]
        if len(set(own)) > 1:
            held = '; '.join(f'rank {r}: {"no len()" if n is None else f"{n} batches"}' for r, n in zip(group, own))
            raise UnevenInputsError(
                f'the ranks of tensor-parallel group {m} (ranks {list(group)}) have {label} dataloaders of '
                f'different lengths ({held}). {_ADVICE}'
            )


def trainer_layout(state: Any) -> Layout:
    """The trainer's layout: TP groups from Composer's device mesh where ``state.tp_config`` is set, else flat.

    Composer 0.32.1 builds the mesh as ``[data_parallel_replicate,] data_parallel_shard[, tensor_parallel]``;
    the groups are read from it by name, whatever the order.
    """
    world = dist.get_world_size()
    mesh = getattr(state, 'device_mesh', None)
    tp_name = ParallelismType.TENSOR_PARALLEL.value
    if getattr(state, 'tp_config', None) is None or mesh is None or tp_name not in (mesh.mesh_dim_names or ()):
        return Layout.flat(world)
    ranks = mesh.mesh
    dim = list(mesh.mesh_dim_names).index(tp_name)
    rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    return Layout(tuple(tuple(int(r) for r in row) for row in rows))
