"""Rebalancing (``UnevenJoin(mode='rebalance')``): leftover batches move to the ranks that ran out, so none idles.

* :mod:`~composer_join.rebalance.rebalance`: ``Rebalancer``, what both schemes share, and the planned schedule
  when every rank has a ``len()`` (``RebalancingLoader``);
* :mod:`~composer_join.rebalance.planning`: that schedule computed in ``O(W log W)`` and kept as its transfers
  (``Schedule``), once per process for given counts;
* :mod:`~composer_join.rebalance.readahead`: the scheme without ``len()``: read-ahead buffers, their levels in
  the agreement, the give/receive rule;
* :mod:`~composer_join.rebalance.transfer`: ``BatchChannel``, the point-to-point transfer of one batch (the
  wire format).

The join's loader (:mod:`composer_join.join.loader`) asks a rebalancer for each step's batch; a rebalancer
knows nothing of shadow steps or of the model.

May import: core.
"""
