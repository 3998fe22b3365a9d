"""Give one token bucket of a launch table the settings another bucket's batches get.

Why: with 16-row tiles a 4-token batch runs the same kernels as an 8-token one, masked rows
aside, yet the decode layer at rank 64 was about a microsecond slower at 4 tokens than at 8
(docs/benchmarks/decode.md): its 4-token entries came from other tuning runs. The tuner's own
margin is below the layer's run-to-run spread, so such a copy is judged by alternating decode
pages (`gpu_kernels.sh use:A decode use:B decode ...`), not by one tuning pass.

For every shape of each op the settings a batch of `--from-tokens` gets at `--rank`
(`launch.table_entry`, as the launchers look them up) are written under that rank's key at
`--to-tokens`, where they differ from what that bucket gets now; with `--one-slot` the settings
of a batch of one adapter slot, under the one-slot key (they then serve such batches only: the
decode benchmark's case; copied as plain rank entries, rank 64's K1 ones made the 32-adapter
layer at 4 tokens 5.5 us slower). The run is recorded in the table's `_meta.runs`:

    python3 tools/copy_table_bucket.py --rank 64 --from-tokens 8 --to-tokens 4 --one-slot \\
        --table packages/epilora-kernels/src/epilora_kernels/configs/NVIDIA_H200.json
"""

import argparse
import json

from epilora_kernels.launch import OPS, shape_key, table_entry, write_table


def copy_bucket(table: dict, ops, rank: int, from_tokens: int, to_tokens: int,
                one_slot: bool) -> list[str]:
    """Edit `table` in place; the changed entries, as 'op shape bucket'."""
    changed = []
    for op in ops:
        plain = {key.partition("@")[0] for key in table.get(op, {})}
        for dims in sorted(plain):
            n, k = (int(d) for d in dims.split("x"))
            source = table_entry(table, op, from_tokens, n, k, rank, one_slot=one_slot)
            if source is None or source == table_entry(table, op, to_tokens, n, k, rank,
                                                       one_slot=one_slot):
                continue
            key = shape_key(n, k, rank, one_slot)
            table[op].setdefault(key, {})[str(to_tokens)] = source.__dict__
            changed.append(f"{op} {key} {to_tokens}")
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", required=True, help="the launch table, edited in place")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=["decode_shrink", "lora_gemm"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--from-tokens", type=int, required=True)
    parser.add_argument("--to-tokens", type=int, required=True)
    parser.add_argument("--one-slot", action="store_true",
                        help="a one-slot batch's settings, under the one-slot key")
    parser.add_argument("--note", default=None, help="recorded with the run in _meta.runs")
    args = parser.parse_args()
    with open(args.table) as f:
        table = json.load(f)
    changed = copy_bucket(table, args.ops, args.rank, args.from_tokens, args.to_tokens,
                          args.one_slot)
    if not changed:
        raise SystemExit(f"nothing to copy: {args.to_tokens} tokens already get the settings "
                         f"of {args.from_tokens} at rank {args.rank}")
    run = {"tool": "tools/copy_table_bucket.py", "ops": list(args.ops), "rank": args.rank,
           "from_tokens": args.from_tokens, "tokens": [args.to_tokens],
           "slots": 1 if args.one_slot else None, "changed": changed}
    if args.note:
        run["note"] = args.note
    table.setdefault("_meta", {}).setdefault("runs", []).append(run)
    write_table(table, args.table)
    print("\n".join(changed))


if __name__ == "__main__":
    main()
