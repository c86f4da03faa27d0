"""Per-epoch accounting: what each rank trained, what it shadowed, and what stock Composer would have dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

from composer_join.core.plan import StepPlan

__all__ = ['EpochReport']


@dataclass
class EpochReport:
    """Counts for one epoch, the same on every rank (from the agreements, and the lengths for planned steps).

    Attributes:
        epoch: the epoch's index.
        real_batches: per rank, batches trained on real data.
        real_samples: per rank, samples in those batches (as Composer counts them; -1 if uncountable).
        shadow_steps: per rank, steps taken on a shadow batch after running out.
        batch_sizes: per rank, the sample count of each real batch, in order; ``-1`` on the steps
            planned from the ranks' lengths without an agreement (their samples are counted in
            ``real_samples`` at the first agreed step, the shortest rank's last batch).
        own_batches, received_batches, given_batches, bytes_sent: with ``mode='rebalance'`` only
            (empty otherwise): per rank, batches trained from its own shard, received from other
            ranks, given to other ranks, and bytes it sent (headers included).
        tensor_parallel: ranks per data-parallel member (:mod:`composer_join.core.layout`); above 1, "rank" above
            and in :meth:`metrics` is the data-parallel rank, each TP group counted once (its bytes: all its ranks').
    """

    epoch: int
    world_size: int
    real_batches: list[int] = field(default_factory=list)
    real_samples: list[int] = field(default_factory=list)
    shadow_steps: list[int] = field(default_factory=list)
    batch_sizes: list[list[int]] = field(default_factory=list)
    own_batches: list[int] = field(default_factory=list)
    received_batches: list[int] = field(default_factory=list)
    given_batches: list[int] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    tensor_parallel: int = 1

    def __post_init__(self):
        w = self.world_size
        self.real_batches = self.real_batches or [0] * w
        self.real_samples = self.real_samples or [0] * w
        self.shadow_steps = self.shadow_steps or [0] * w
        self.batch_sizes = self.batch_sizes or [[] for _ in range(w)]

    def record(self, plan: StepPlan) -> None:
        """Add one step (called by the loader once per step, agreed or planned from the lengths)."""
        for rank, status in enumerate(plan.statuses):
            if not plan.agreed:  # every rank has a batch; its size reaches every rank later, as unreported_samples
                self.real_batches[rank] += 1
                self.batch_sizes[rank].append(-1)
                continue
            if status.unreported_samples != 0 and self.real_samples[rank] >= 0:
                self.real_samples[rank] = (
                    -1 if status.unreported_samples < 0 else self.real_samples[rank] + status.unreported_samples
                )
            if status.has_batch:
                self.real_batches[rank] += 1
                self.batch_sizes[rank].append(status.samples)
                if self.real_samples[rank] >= 0:
                    self.real_samples[rank] = self.real_samples[rank] + status.samples if status.samples >= 0 else -1
            else:
                self.shadow_steps[rank] += 1

    @property
    def steps(self) -> int:
        return max(self.real_batches, default=0)

    @property
    def rebalanced(self) -> bool:
        return bool(self.own_batches)

    @property
    def bytes_moved(self) -> int:
        """Bytes sent between ranks this epoch to rebalance (0 in ``mode='shadow'``)."""
        return sum(self.bytes_sent)

    @property
    def shard_batches(self) -> list[int]:
        """Per rank, the batches of its own shard (trained by it or given away)."""
        if self.rebalanced:
            return [o + g for o, g in zip(self.own_batches, self.given_batches)]
        return self.real_batches

    @property
    def stock_dropped_batches(self) -> int:
        """Batches stock Composer would not train: it ends every epoch at the shortest rank."""
        shortest = min(self.shard_batches, default=0)
        return sum(n - shortest for n in self.shard_batches)

    @property
    def stock_dropped_samples(self) -> int:
        """Samples in those batches (-1 if some could not be counted, or the run rebalanced batches)."""
        if self.rebalanced:
            return -1
        shortest = min(self.real_batches, default=0)
        tails = [s for sizes in self.batch_sizes for s in sizes[shortest:]]
        return -1 if any(s < 0 for s in tails) else sum(tails)

    def metrics(self) -> dict[str, int]:
        """The report as Composer logger metrics, under ``uneven_join/``."""
        out = {
            'uneven_join/epoch_steps': self.steps,
            'uneven_join/stock_would_drop_batches': self.stock_dropped_batches,
            'uneven_join/stock_would_drop_samples': self.stock_dropped_samples,
        }
        for rank in range(self.world_size):
            out[f'uneven_join/rank_{rank}/real_batches'] = self.real_batches[rank]
            out[f'uneven_join/rank_{rank}/real_samples'] = self.real_samples[rank]
            out[f'uneven_join/rank_{rank}/shadow_steps'] = self.shadow_steps[rank]
            if self.rebalanced:
                out[f'uneven_join/rank_{rank}/own_batches'] = self.own_batches[rank]
                out[f'uneven_join/rank_{rank}/received_batches'] = self.received_batches[rank]
                out[f'uneven_join/rank_{rank}/given_batches'] = self.given_batches[rank]
                out[f'uneven_join/rank_{rank}/bytes_sent'] = self.bytes_sent[rank]
        if self.rebalanced:
            out['uneven_join/bytes_moved'] = self.bytes_moved
        return out

    def summary(self) -> str:
        """A few lines for people: per rank, real batches, samples and shadow steps."""
        lines = [f'epoch {self.epoch}: {self.steps} steps on all ranks']
        for rank in range(self.world_size):
            moved = (
                f': {self.own_batches[rank]} own, {self.received_batches[rank]} received, '
                f'{self.given_batches[rank]} given away'
                if self.rebalanced
                else ''
            )
            who = f'data-parallel rank {rank}' if self.tensor_parallel > 1 else f'rank {rank}'
            lines.append(
                f'  {who}: {self.real_batches[rank]} real batches ({self.real_samples[rank]} samples){moved}, '
                f'{self.shadow_steps[rank]} shadow steps',
            )
        if self.rebalanced:
            lines.append(f'  {self.bytes_moved} bytes moved between ranks')
            lines.append(f'  stock Composer would have dropped {self.stock_dropped_batches} batches')
        else:
            lines.append(
                f'  stock Composer would have dropped {self.stock_dropped_batches} batches '
                f'({self.stock_dropped_samples} samples)',
            )
        return '\n'.join(lines)
