import sys
from pathlib import Path

# the tiny random checkpoints (and their fixture) live with the engine tests
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from tiny_models import tiny_model  # noqa: E402,F401  (the fixture)
