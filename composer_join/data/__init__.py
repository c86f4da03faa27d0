"""What the ranks read and where they stand in it: the exact sampler, and per-rank positions for resumption.

* :mod:`~composer_join.data.sampler`: :class:`~composer_join.ExactDistributedSampler`, a
  ``DistributedSampler`` that neither pads nor drops;
* :mod:`~composer_join.data.positions`: one adapter per way a data library keeps its position (torchdata,
  litdata, Hugging Face ``datasets``, Composer's protocol), chosen by what the object is; registering one;
* :mod:`~composer_join.data.elastic`: a mid-epoch checkpoint of data sharded in one global index space
  (``DistributedSampler``, ``ExactDistributedSampler``) resumed on any number of ranks;
* :mod:`~composer_join.data.resume`: where each rank's train dataloader stands in a checkpoint, and the
  plain data UnevenJoin keeps in one.

May import: core.
"""
