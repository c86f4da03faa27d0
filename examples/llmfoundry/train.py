"""Run llm-foundry's own ``train_from_yaml`` (what its ``scripts/train/train.py`` does), with Composer's launcher.

    composer -n 2 examples/llmfoundry/train.py examples/llmfoundry/uneven_mpt.yaml variables.data_dir=/tmp/uneven-mpt

Arguments after the YAML are omegaconf dotlist overrides.
"""

import sys

from llmfoundry.command_utils import train_from_yaml

if __name__ == '__main__':
    train_from_yaml(sys.argv[1], sys.argv[2:])
