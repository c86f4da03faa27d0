"""``examples/llmfoundry/train.py`` on CPU with FSDP: the test-only workaround of tests/scenarios_fsdp.py first.

Not a test module. Run by tests/test_llmfoundry.py with Composer's launcher::

    composer -n 4 tests/train_llmfoundry_cpu.py examples/llmfoundry/uneven_mpt_tp.yaml variables.data_dir=...
"""

import sys
from pathlib import Path

if __name__ == '__main__':
    sys.path.insert(0, str(Path(__file__).parent))
    from llmfoundry.command_utils import train_from_yaml

    import scenarios_fsdp

    scenarios_fsdp.cpu_fsdp_workarounds()
    train_from_yaml(sys.argv[1], sys.argv[2:])
