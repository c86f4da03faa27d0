"""Living beside the rest of Composer: the parts of its loop that a shadowing rank must meet the same way.

* :mod:`~composer_join.interop.oom`: automatic microbatching's OOM checks at the same points on every rank,
  and evaluation retries;
* :mod:`~composer_join.interop.metrics`: metrics whose state is a list, made syncable on a rank that
  evaluated nothing;
* :mod:`~composer_join.interop.predict`: ``Trainer.predict()``, with empty outputs for shadow batches;
* :mod:`~composer_join.interop.replan`: re-agreeing a step's counts after another algorithm reshaped the batch;
* :mod:`~composer_join.interop.closures`: optimizers that branch on the closure's loss (SAM);
* :mod:`~composer_join.interop.refusals`: algorithms that cannot run beside UnevenJoin, refused at ``FIT_START``;
* :mod:`~composer_join.interop.launchers`: what Composer's ``autoresume`` needs from torchrun and from nodes sharing
  a save folder (:func:`~composer_join.launcher_compat`).

Each module is a function or a small class that the algorithm calls at one event (``launchers``: that a training
script calls around ``Trainer()``); none holds the join's state.
Where UnevenJoin sits among Composer's *algorithms* is :mod:`composer_join.join.passes` (it needs the algorithm).

May import: core.
"""
