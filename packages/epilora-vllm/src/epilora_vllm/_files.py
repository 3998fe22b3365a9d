"""Files the plugin keeps in its cache directory (the timed dispatch's choices, the precompile's
records)."""

import json
import os
import threading
from pathlib import Path


def write_json(path: Path, data, **dumps) -> None:
    """`data` as JSON at `path`, atomically: a reader, or a start killed mid-write, sees the
    previous file or the whole new one. Raises OSError (a read-only cache directory, say)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    partial.write_text(json.dumps(data, **dumps))
    partial.replace(path)
