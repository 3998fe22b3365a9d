"""Files the plugin keeps in its cache directory (the timed dispatch's choices, the precompile's
records)."""

import fcntl
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


def merge_json(path: Path, data: dict, **dumps) -> dict:
    """`data`'s keys written over the JSON object at `path` (`write_json`'s way), one process at
    a time (an exclusive lock beside it): engines' ranks writing at once keep each other's
    keys. Returns what was written. A file that is not a JSON object is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            merged = json.loads(path.read_text())
        except (OSError, ValueError):
            merged = None
        merged = {**(merged if isinstance(merged, dict) else {}), **data}
        write_json(path, merged, **dumps)
    return merged
