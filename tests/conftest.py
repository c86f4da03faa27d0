import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fork_guard

fork_guard.install()  # before any DataLoader forks a worker, here or in a rank (tests/fork_guard.py)
