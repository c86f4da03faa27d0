"""composer-join: data-parallel training in MosaicML Composer when ranks have different amounts of data.

Switch it on with one algorithm::

    from composer_join import UnevenJoin
    trainer = Trainer(..., algorithms=[UnevenJoin()])
"""

from composer_join.algorithm import UnevenJoin, is_shadow_step
from composer_join.collectives import CollectiveCounter
from composer_join.errors import UnevenInputsError
from composer_join.passes import install as _install_join_pass
from composer_join.report import EpochReport
from composer_join.sampler import ExactDistributedSampler

__all__ = [
    'CollectiveCounter',
    'EpochReport',
    'ExactDistributedSampler',
    'UnevenInputsError',
    'UnevenJoin',
    'is_shadow_step',
]

_install_join_pass()  # UnevenJoin's place among the algorithms, per event (composer_join.passes)

__version__ = '0.1.0'
