"""YAML trainer configs: generic machinery, not the join (it should not grow with it).

* :mod:`~composer_join.config.config`: load a config with omegaconf, check it against ``composer.Trainer``,
  build its arguments;
* :mod:`~composer_join.config.registry`: the names of components (``uneven_join``, Composer's algorithms,
  callbacks, loggers, schedulers, optimizers).

May import: join (for :class:`~composer_join.UnevenJoin`'s name).
"""
