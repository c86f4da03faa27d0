"""The join itself: the algorithm that routes Composer's events, its sessions, and the loader that plans each step.

* :mod:`~composer_join.join.algorithm`: :class:`~composer_join.UnevenJoin`, which only routes events (a table)
  to the run, and asks it which events to match;
* :mod:`~composer_join.join.session`: ``Run``: what UnevenJoin holds for one trainer while active: the current
  sessions, and which events they take;
* :mod:`~composer_join.join.context`: ``Context``: what one trainer's sessions share (settings, wrapper part,
  layout, reports);
* :mod:`~composer_join.join.fit`: ``FitSession``: one ``fit()``: its train loader, positions and register of
  changes, the work at its events, which steps UnevenJoin runs in;
* :mod:`~composer_join.join.fitdata`: where a fit's train data starts (a checkpoint, the rest of an epoch on
  another world size), the per-rank positions, the train loader;
* :mod:`~composer_join.join.evaluation`: ``EvalSession``: one evaluation or ``predict()``;
* :mod:`~composer_join.join.microbatches`: ``Microbatch``, the record of each microbatch (shadow or real, made
  once); ``Microbatches``: its input, the metrics a stand-in keeps out; ``Step``: what one step changed;
* :mod:`~composer_join.join.loader`: the Composer-facing glue: ``join_dataloader`` builds the loader and sets it
  as ``state.dataloader``, ``lift_cap``; ``batch_source``, the one place the source of batches is chosen;
* :mod:`~composer_join.join.iterator`: ``JoinLoader``, which only iterates: per step this rank's batch or a
  shadow batch, as the protocol (:mod:`composer_join.core.protocol`) decides, and the step's frozen record;
* :mod:`~composer_join.join.passes`: the algorithm pass: where UnevenJoin runs among Composer's other
  algorithms, per event.

One training step goes: ``JoinLoader`` (plan, batch) -> the fit's session (the step watched or not) -> the wrapper
(:mod:`composer_join.wrappers`) -> the shadow parts (:mod:`composer_join.shadow`) and Composer's loop
(:mod:`composer_join.interop`) -> the report (:mod:`composer_join.core.report`).

May import: core, interop, shadow, rebalance, wrappers, data.
"""
