"""Rewrite committed result files in `epilora_testing.results.results_text`'s layout (one row a
line), their data unchanged: each file is reloaded after the rewrite and compared with what it
held. Files that are not `{"meta", "rows"}` objects are left alone.

    python tools/compact_results.py benchmarks/results
"""

import argparse
import json
from pathlib import Path

from epilora_testing.results import results_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args()
    before_bytes = after_bytes = 0
    for path in sorted(p for folder in args.folders for p in folder.rglob("*.json")):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and set(data) == {"meta", "rows"}
                and isinstance(data["rows"], list)):
            continue
        text = results_text(data["meta"], data["rows"])
        if json.loads(text) != data:
            raise SystemExit(f"{path}: the rewrite would change its data")
        before_bytes += path.stat().st_size
        path.write_text(text)
        after_bytes += len(text.encode())
    print(f"{before_bytes} -> {after_bytes} bytes")


if __name__ == "__main__":
    main()
