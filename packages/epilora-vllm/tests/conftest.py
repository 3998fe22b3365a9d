# engine_cases.py (shared by these tests and tests/gpu/) is imported by name; pytest's importlib
# mode does not put test folders on sys.path.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
