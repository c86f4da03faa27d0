"""composer-join: data-parallel training in MosaicML Composer when ranks have different amounts of data.

Switch it on with one algorithm::

    from composer_join import UnevenJoin
    trainer = Trainer(..., algorithms=[UnevenJoin()])
"""

from composer_join.collectives import CollectiveCounter
from composer_join.core.errors import UnevenInputsError
from composer_join.core.report import EpochReport
from composer_join.data.positions import Position, Reading, SampleCountPosition, TrailPosition, register_position
from composer_join.data.sampler import ExactDistributedSampler
from composer_join.interop.launchers import launcher_compat
from composer_join.join.algorithm import UnevenJoin, is_shadow_step
from composer_join.join.passes import install as _install_join_pass

__all__ = [
    'CollectiveCounter',
    'EpochReport',
    'ExactDistributedSampler',
    'Position',
    'Reading',
    'SampleCountPosition',
    'TrailPosition',
    'UnevenInputsError',
    'UnevenJoin',
    'is_shadow_step',
    'launcher_compat',
    'register_position',
]

_install_join_pass()  # UnevenJoin's place among the algorithms, per event (composer_join.join.passes)

__version__ = '0.1.0'
