"""The join's vocabulary, shared by every other subpackage: what a step is and how ranks agree on it.

* :mod:`~composer_join.core.plan`: what a step is, as data (:class:`~composer_join.core.plan.StepPlan`): which
  ranks have data, their sample and microbatch counts, failures;
* :mod:`~composer_join.core.protocol`: the join's decisions, step by step, from every rank's rows (one small
  all-reduce, or none when the ranks' lengths already say it) over an injected exchange: no Composer, no
  collective of its own;
* :mod:`~composer_join.core.exchange`: the real exchange (``torch.distributed``) and the first agreement;
* :mod:`~composer_join.core.layout`: :class:`~composer_join.core.layout.Layout`, which ranks are one data-parallel
  member (a tensor-parallel group joins as one), and the check that a member's ranks hold the same batch;
* :mod:`~composer_join.core.report`: :class:`~composer_join.EpochReport`, what each rank trained and shadowed;
* :mod:`~composer_join.core.settings`: UnevenJoin's settings, compared across ranks in the first agreement;
* :mod:`~composer_join.core.batches`: batch trees: mapping over their tensors, taking their first samples;
* :mod:`~composer_join.core.errors`: :class:`~composer_join.UnevenInputsError`;
* :mod:`~composer_join.core.peers`: a peer gone while a rank waits in one of UnevenJoin's collectives: what it says;
* :mod:`~composer_join.core.compat`: the private names of other packages composer-join reads, in one place.

Nothing here knows Composer's events or the model's wrapper; it is the bottom layer.

May import: nothing of composer_join outside core.
"""
