"""The join itself: the algorithm that routes Composer's events, and the loader that plans each step.

* :mod:`~composer_join.join.algorithm`: :class:`~composer_join.UnevenJoin`, which only routes events (a table)
  to the run;
* :mod:`~composer_join.join.session`: ``Run``: what UnevenJoin holds for one trainer while active (its loaders,
  positions, wrapper part) and the work at each event;
* :mod:`~composer_join.join.microbatches`: ``Microbatches``: each microbatch shadow or real, its input, the
  metrics a stand-in keeps out;
* :mod:`~composer_join.join.loader`: the Composer-facing glue: ``join_dataloader`` builds the loader and sets it
  as ``state.dataloader``, ``lift_cap``; ``batch_source``, the one place the source of batches is chosen;
* :mod:`~composer_join.join.iterator`: ``JoinLoader``, which only iterates: per step this rank's batch or a
  shadow batch, as the protocol (:mod:`composer_join.core.protocol`) decides, and the step's frozen record;
* :mod:`~composer_join.join.passes`: the algorithm pass: where UnevenJoin runs among Composer's other
  algorithms, per event.

One training step goes: ``JoinLoader`` (plan, batch) -> the wrapper (:mod:`composer_join.wrappers`) -> the
shadow parts (:mod:`composer_join.shadow`) and Composer's loop (:mod:`composer_join.interop`) -> the report
(:mod:`composer_join.core.report`).

May import: core, interop, shadow, rebalance, wrappers, data.
"""
