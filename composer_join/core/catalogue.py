"""Every collective UnevenJoin issues, and the fact that decides, alike on every rank, whether it runs.

A collective that runs on some ranks only hangs (or, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, stops with "Detected
mismatch between collectives"). So whether each runs is decided from facts every rank has alike: what the ranks
agreed on (the first agreement of a fit, evaluation or ``predict()``, the step plans), Composer's own events and
timestamps, or settings Composer and torch already require to be the same on every rank. This module is the list:
one :class:`Collective` per collective, with where it is issued and what gates it.

Who calls what: every collective of UnevenJoin's own goes through the exchange
(:class:`~composer_join.core.exchange.TorchExchange`: ``rows``, ``reduce``, ``gather``, ``broadcast``) with its entry's
words for the call (:meth:`Collective.said`, which the exchange reads back to name the collective, and which a rank
that finds a peer gone says). The entries whose ``direct`` names modules are torch's and DDP's own collectives
that UnevenJoin triggers or replays (DDP's buffer broadcast, a shadow microbatch's bucket all-reduces, the transfers'
``send``/``recv``, ``new_group``): the functions named there are called by those modules themselves. docs/how-it-works.md's table
"The collectives, and what decides them" is this list, row for row; tests/test_catalogue.py checks both that and that
no other module calls a ``torch.distributed`` collective. Nothing here runs anything.

Example::

    from composer_join.core.catalogue import RECOUNT

    exchange.rows([samples, microbatches], RECOUNT.said(f'the recount of step {step}')).wait()
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ['CATALOGUE', 'Collective', 'Said']


class Collective(NamedTuple):
    """One of UnevenJoin's collectives (a row of docs/how-it-works.md's table)."""

    name: str
    """Its key (lower case, as its constant's name)."""
    what: str
    """What it is and what it moves."""
    where: str
    """Where it is issued (module, object)."""
    when: str
    """When it runs: the fact that decides it, and why every rank has it alike."""
    direct: tuple[tuple[str, str], ...] = ()
    """Where it is issued through ``torch.distributed`` or DDP themselves, not through the exchange: ``(module under
    composer_join/, the function called)`` pairs; empty: through the exchange."""

    def said(self, words: str) -> Said:
        """``words`` for one call of this collective (what a rank says if a peer is gone while it waits), carrying
        this entry for whoever lists the collectives issued."""
        return Said(words, self)


class Said(str):
    """The words of one call of a :class:`Collective` (a ``str``, so every exchange takes it as words), and the entry."""

    collective: Collective

    def __new__(cls, words: str, collective: Collective) -> Said:
        said = super().__new__(cls, words)
        said.collective = collective
        return said


FIRST_AGREEMENT = Collective(
    'first_agreement',
    'the first agreement: one all-reduce of a row per rank (lengths, settings, `Facts`)',
    '`core/exchange.py` `agree_on_length`',
    "every `FIT_START`, `EVAL_START`, `PREDICT_START` (Composer's events, on every rank); once more when the rest of an epoch resumed elastically ends; a rank with `enable=False` at its first start",
    (),
)

STEP_AGREEMENT = Collective(
    'step_agreement',
    'the step agreement: one all-reduce of `104 * W` bytes',
    '`core/protocol.py` `Agreement`, through `core/exchange.py` `TorchExchange`',
    "on the steps not planned from the lengths: from the shortest rank's last batch on, every step where some rank has no `len()` or under tensor parallelism (the agreed lengths and layout); with read-ahead rebalancing, where the agreed buffer levels say so",
    (),
)

WHO_FAILED = Collective(
    'who_failed',
    'who failed: an all-reduce, then an `all_gather_object` of the causes',
    '`core/protocol.py` `Protocol.check_ended_together`',
    'at `EPOCH_END`/`EVAL_END`/`PREDICT_END` of a loop that ended before the agreed length, not by agreement (Composer\'s own per-step "exhausted" all-reduce ended it on every rank); the gather only where the all-reduce says some rank raised',
    (),
)

NOTHING_UNREAD = Collective(
    'nothing_unread',
    "whether a dataloader of `len()` 0 yields a batch: one integer per rank, in the agreement's table all-reduce (`Exchange.rows`)",
    '`core/protocol.py` `Protocol.check_nothing_unread`',
    "as Composer's loop over a loader starts, where every rank's `len()` is 0 and no cap was asked for (the first agreement's lengths) and the cap is not lifted (`Facts.overcounts`, first agreement): Composer reads no batch there, so a batch would be lost",
    (),
)

STRUCTURES = Collective(
    'structures',
    "the batches' structures: `all_gather_object`",
    '`core/protocol.py` `Protocol.verdict`',
    "where the step plan says ranks shadow with a structure that differs from the real batches' (an error follows)",
    (),
)

TEMPLATE = Collective(
    'template',
    'a template for a rank that never had data: `broadcast_object_list`',
    '`join/iterator.py`, where the verdict says',
    'where the step plan says some rank needs one',
    (),
)

RECOUNT = Collective(
    'recount',
    "the counts again: two integers per rank, in the agreement's table all-reduce (`Exchange.rows`)",
    '`interop/replan.py`',
    "every *agreed* training step's `AFTER_DATALOADER` (`StepPlan.agreed`) where some rank's trainer has an algorithm besides UnevenJoin (`Facts.others`, first agreement), whatever each algorithm matches on each rank, or some rank's train `DataSpec` has a `batch_transforms` of the user's (`Facts.transforms`: Composer counts and trains the transformed batch); on a step planned from the lengths only this rank's own counts are renewed, with no collective",
    (),
)

POSITIONS = Collective(
    'positions',
    "every rank's position in its train data: `all_gather_object`",
    '`data/resume.py` `RankPositions.gather`',
    "at the `*_CHECKPOINT` event where Composer's `CheckpointSaver` saves (its `save_interval`: Composer's save all-gathers RNG states on every rank, so it must be the same everywhere) and at `FIT_END`, once per timestamp, where the agreed position kind is kept per rank (`Facts.position`: see below)",
    (),
)

DDP_BUFFERS = Collective(
    'ddp_buffers',
    "DDP's buffers: DDP's broadcast, from the agreed buffer source",
    '`wrappers/ddp.py`',
    "DDP's own, before a synced forward (its hook names the source from the step plans); again at `FIT_END`, `EVAL_START` and where a checkpoint is saved, if DDP broadcasts buffers (DDP's setting)",
    (('core/compat.py', 'broadcast_ddp_buffers'),),
)

DDP_SHADOW = Collective(
    'ddp_shadow',
    "a shadow microbatch's DDP collectives (buffer broadcast, one all-reduce per bucket, the used-parameter map, the first bucket rebuild)",
    '`shadow/shadow.py` `DDPShadow`',
    "on shadow microbatches (the step plan) where shadow microbatches run no model code (`Facts.shadow`: the way, agreed at `FIT_START`), on a rank that has seen a loss of the model (`Facts.fresh`: one that has not runs the model on the template instead, a forward) and unless some rank's probe found a collective in the model's forward (`Facts.forward`, and this fit's probes at its first step: every rank then stops at the first shadow step)",
    (('shadow/shadow.py', 'allreduce'),),
)

GRADIENT_PRESENCE = Collective(
    'gradient_presence',
    'gradients present on some rank: an all-reduce of one byte per parameter',
    '`shadow/gradients.py` `share_grad_presence`',
    "`forced_sync` (Composer's `ddp_sync_strategy`) after each rank's last microbatch, with `find_unused_parameters` (DDP's) or a shadowing rank (the step plan)",
    (),
)

UNUSED_PARAMETERS = Collective(
    'unused_parameters',
    'parameters no real sample used: an all-reduce of one byte per parameter',
    '`shadow/gradients.py` `UnusedParameters.finish`',
    "after each rank's last microbatch of a step where the plan has shadowing ranks and every rank's count, and shadow microbatches run the model (`Facts.shadow`; a rank that needs a template: the plan; or, at the fit's first step, a shadowing rank that had seen no loss of the model when the fit started: `Facts.fresh`, first agreement)",
    (),
)

MICROBATCH_COUNTS = Collective(
    'microbatch_counts',
    "the step's largest microbatch count: an all-reduce",
    '`shadow/padding.py`',
    "at Composer's split of a step whose plan lacks some rank's count, where microbatches are padded (FSDP: Composer's parallelism; DDP: the `'zero'` way, `Facts.shadow`) or automatic microbatching is on (Composer's setting: its own OOM all-reduces require it everywhere)",
    (),
)

STATIC_GRAPH_COUNTS = Collective(
    'static_graph_counts',
    "the microbatch counts of DDP's first static-graph step: one integer per rank, in the agreement's table all-reduce (`Exchange.rows`)",
    '`wrappers/static_graph.py` `first_iteration_syncs`',
    "once per DDP object with `static_graph` (DDP's setting), at the step of its first synced backward (DDP's own state, the same on every rank), where that step is planned from the lengths (`StepPlan.agreed`: an agreed plan holds the counts already)",
    (),
)

ZERO_SAMPLES = Collective(
    'zero_samples',
    "whether every rank's model takes zero samples: one integer per rank, in the agreement's table all-reduce (`Exchange.rows`)",
    '`shadow/zero_samples.py` `ZeroSampleCheck.check`',
    "once per fit, at the first microbatch, where shadow microbatches run the forward on zero samples (`Facts.shadow`: the `'zero'` way, agreed at `FIT_START`)",
    (),
)

FSDP_UNITS = Collective(
    'fsdp_units',
    'used FSDP units: a sum of `units + 1` integers on the host (gloo), an all-reduce under 8 ranks, from 8 on pairwise `isend`/`irecv` in `log2 W` rounds (`TorchExchange.host_sum`); an `all_gather_object` naming the failing ranks where some rank failed',
    '`wrappers/fsdp.py` `GradientUnits.check`',
    "every microbatch under FSDP (Composer's parallelism)",
    (),
)

METRIC_LISTS = Collective(
    'metric_lists',
    'list-state metrics padded: an all-reduce of the counts',
    '`interop/metrics.py`',
    "before Composer computes metrics that have list states not reduced by concatenation (the metrics: torchmetrics' own sync requires the same on every rank)",
    (),
)

BYTES_SENT = Collective(
    'bytes_sent',
    'bytes each rank sent: an all-reduce',
    '`rebalance/rebalance.py`',
    "`EPOCH_END` with `mode='rebalance'` (a setting, agreed), unless the epoch was trained before the checkpoint resumed (the checkpoint and world size: the same everywhere)",
    (),
)

READAHEAD_LEVELS = Collective(
    'readahead_levels',
    'read-ahead buffer levels: an all-reduce (through the exchange)',
    '`rebalance/readahead.py`',
    "each epoch's start, rebalancing without some rank's `len()` (the setting and the agreed lengths)",
    (),
)

TRANSFERS = Collective(
    'transfers',
    "batch transfers: `send`/`recv` (a group of their own, the channel's `Wire`)",
    '`rebalance/transfer.py`',
    'the rebalancing schedule (the agreed lengths) or the read-ahead rule (the agreed levels)',
    (('rebalance/transfer.py', 'send'), ('rebalance/transfer.py', 'recv')),
)

NEW_GROUP = Collective(
    'new_group',
    '`new_group` (collective)',
    '`rebalance/transfer.py`, `wrappers/fsdp.py`',
    "the first batch channel (`mode='rebalance'`, at `FIT_START`); under NCCL, FSDP's gloo group for the unit check, at the first `FIT_START` of a model with units (Composer's parallelism)",
    (('rebalance/transfer.py', 'new_group'), ('wrappers/fsdp.py', 'new_group')),
)

CATALOGUE = (
    FIRST_AGREEMENT,
    STEP_AGREEMENT,
    WHO_FAILED,
    NOTHING_UNREAD,
    STRUCTURES,
    TEMPLATE,
    RECOUNT,
    POSITIONS,
    DDP_BUFFERS,
    DDP_SHADOW,
    GRADIENT_PRESENCE,
    UNUSED_PARAMETERS,
    MICROBATCH_COUNTS,
    STATIC_GRAPH_COUNTS,
    ZERO_SAMPLES,
    FSDP_UNITS,
    METRIC_LISTS,
    BYTES_SENT,
    READAHEAD_LEVELS,
    TRANSFERS,
    NEW_GROUP,
)
