"""Inert shadow steps: a joined rank's step issues every collective of a real one and changes nothing.

* :mod:`~composer_join.shadow.shadow`: under DDP, DDP's collectives with no model code (``DDPShadow``),
  the stand-in loss, which forwards communicate;
* :mod:`~composer_join.shadow.gradients`: a rank's gradient weight (0 when shadowing, ``A_t / W``) without
  changing the loss it reports;
* :mod:`~composer_join.shadow.buffers`: BatchNorm statistics kept out of reach of stand-in forwards;
* :mod:`~composer_join.shadow.padding`: every rank's microbatches padded to the step's largest count;
* :mod:`~composer_join.shadow.dataspec`: counting and splitting batches with the ``DataSpec`` Composer uses;
* :mod:`~composer_join.shadow.structure`: a batch's structure, compared across ranks (the template check).

The wrappers (:mod:`composer_join.wrappers`) decide when each of these runs; this package only does it.

May import: core, interop.
"""
