"""Ship a device's tuner cache in its launch table, so that engines on that device start without
tuning the shapes it covers.

`epilora_kernels.tuner.tune_decode` writes its winners into a cache file that is itself a launch
table (`gpu_kernels.sh tune-decode` brings a copy back in `$OUT/tune-cache/`). Here
every (op, shape, token bucket) entry of that file replaces the shipped table's, as the tuner
wrote it; the cache's runs join the table's `_meta.runs`, stamped with the commit they were tuned
at; the merged table is validated (`launch.validate_table`) before it is written, and every
entry added or changed is printed. Nothing is typed by hand.

    python tools/ship_tuner_cache.py CACHE.json --git-sha SHA \\
        [--table packages/epilora-kernels/src/epilora_kernels/configs/NVIDIA_H200.json]
"""

import argparse
import json
from pathlib import Path

from epilora_kernels.launch import table_name, validate_table, write_table

CONFIGS = Path(__file__).parents[1] / "packages/epilora-kernels/src/epilora_kernels/configs"


def ship(cache: dict, table: dict, git_sha: str) -> tuple[dict, list[str]]:
    """`table` with `cache`'s entries in it, and what changed ("op shape bucket: was -> now")."""
    validate_table(cache)
    merged = json.loads(json.dumps(table))  # a copy, the table's own order kept
    changes = []
    for op, shapes in cache.items():
        if op == "_meta":
            continue
        for shape, buckets in shapes.items():
            entries = merged.setdefault(op, {}).setdefault(shape, {})
            for bucket, fields in buckets.items():
                if entries.get(bucket) != fields:
                    changes.append(f"{op} {shape} {bucket}: {entries.get(bucket)} -> {fields}")
                entries[bucket] = fields
    runs = merged.setdefault("_meta", {}).setdefault("runs", [])
    for run in cache.get("_meta", {}).get("runs", []):
        runs.append({**run, "git_sha": git_sha, "shipped_by": "tools/ship_tuner_cache.py"})
    validate_table(merged)
    return merged, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path)
    parser.add_argument("--git-sha", required=True, help="the commit the cache was tuned at")
    parser.add_argument("--table", type=Path,
                        help="the launch table to merge into (default: the cache's device's)")
    args = parser.parse_args()
    cache = json.loads(args.cache.read_text())
    devices = {run.get("device") for run in cache.get("_meta", {}).get("runs", [])}
    if len(devices) != 1 or None in devices:
        raise SystemExit(f"{args.cache}: expected the runs of one device, found {devices}")
    (device,) = devices
    path = args.table or CONFIGS / table_name(device)
    if path.name != table_name(device):
        raise SystemExit(f"{args.cache} was tuned on {device}: its table is "
                         f"{table_name(device)}, not {path.name}")
    table = json.loads(path.read_text()) if path.is_file() else {}
    merged, changes = ship(cache, table, args.git_sha)
    write_table(merged, path)
    print("\n".join(changes) or "no entry changed")
    print(f"{len(changes)} entries added or changed in {path}")


if __name__ == "__main__":
    main()
