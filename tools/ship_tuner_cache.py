"""Ship a device's tuner cache in its launch table, so that engines on that device start without
tuning the shapes it covers.

`epilora_kernels.tuner.tune_decode` writes its winners into a cache file that is itself a launch
table (`gpu_kernels.sh tune-decode` brings a copy back in `$OUT/tune-cache/`). Here each
(op, shape) of that file replaces the shipped table's whole, as an engine with the cache reads
them (`launch._load_table` overlays the cache shape by shape: the table's other buckets of that
shape were not what the engine ran); the cache's runs join the table's `_meta.runs`, stamped
with the commit they were tuned at; the merged table is validated (`launch.validate_table`)
before it is written, and every bucket added, changed or dropped is printed. The table must
exist: a device without one reads its architecture's (an H100 the H200's), which is where its
cache goes (`--table`). Nothing is typed by hand.

    python tools/ship_tuner_cache.py CACHE.json --git-sha SHA \\
        [--table packages/epilora-kernels/src/epilora_kernels/configs/NVIDIA_H200.json]
"""

import argparse
import json
from pathlib import Path

from epilora_kernels.launch import stale_path_choices, table_name, validate_table, write_table

CONFIGS = Path(__file__).parents[1] / "packages/epilora-kernels/src/epilora_kernels/configs"


def ship(cache: dict, table: dict, git_sha: str) -> tuple[dict, list[str]]:
    """`table` with `cache`'s shapes in it, and what changed ("op shape bucket: was -> now")."""
    validate_table(cache)
    merged = json.loads(json.dumps(table))  # a copy, the table's own order kept
    changes = []
    for op, shapes in cache.items():
        if op == "_meta":
            continue
        for shape, buckets in shapes.items():
            was = merged.setdefault(op, {}).get(shape, {})
            for bucket in sorted({*was, *buckets}, key=int):
                if was.get(bucket) != buckets.get(bucket):
                    changes.append(f"{op} {shape} {bucket}: {was.get(bucket)} -> "
                                   f"{buckets.get(bucket)}")
            merged[op][shape] = dict(buckets)
    # A path choice was timed with the GEMM settings of its run: where the cache brings a
    # shape's GEMM settings but no choice for it, the table's choice goes with its settings.
    for op, shape in stale_path_choices(table, cache):
        changes += [f"{op} {shape} {bucket}: {entry} -> None"
                    for bucket, entry in merged[op].pop(shape).items()]
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
    if args.table is None:
        if len(devices) != 1 or None in devices:
            raise SystemExit(f"{args.cache}: the runs of one device expected (found {devices}); "
                             "name the table with --table")
        path = CONFIGS / table_name(devices.pop())
    else:
        path = args.table
        if len(devices) == 1 and None not in devices and path.name != table_name(*devices):
            raise SystemExit(f"{args.cache} was tuned on {devices.pop()}, not for {path.name}")
    if not path.is_file():
        raise SystemExit(f"{path}: no such table (a device without one reads its "
                         "architecture's: ship into that one with --table)")
    table = json.loads(path.read_text())
    merged, changes = ship(cache, table, args.git_sha)
    write_table(merged, path)
    print("\n".join(changes) or "no entry changed")
    print(f"{len(changes)} entries added or changed in {path}")


if __name__ == "__main__":
    main()
