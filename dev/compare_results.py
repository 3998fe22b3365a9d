"""Side-by-side table of benchmark result files: the same rows (layer.py's or
decode_timeline.py's) from several runs, e.g. the branches one device call timed with
`gpu_kernels.sh use:REF`, each as LABEL=PATH, the first the baseline. Prints markdown: per
(adapters, rank, tokens, system) each run's value and its difference from the baseline, in the
unit of the rows (us); `--systems` keeps only those systems (a timeline's variants are its systems),
`--common` only the rows every run has (a run of a few setups against a whole page).

    python dev/compare_results.py main=out/main/layer.json next=out/next-x/layer.json \
        --systems epilora-fused

(the files of `gpu_kernels.sh use:main layer use:next/x layer`, unpacked into out/ with
tools/device/unpack.sh). Why it exists: a claim that a branch made something faster is then a
script's output over result files, not arithmetic done by hand.
"""

import argparse
import json


def _rows(path: str, systems: set[str] | None) -> dict[tuple, float]:
    """(adapters, rank, tokens, system) -> the layer's time, from one result file."""
    out = {}
    for row in json.loads(open(path).read())["rows"]:
        if row.get("metric") != "layer_us" or row.get("value") is None:
            continue
        if systems and row["system"] not in systems:
            continue
        out[(row["adapters"], row["rank"], row["tokens"], row["system"])] = float(row["value"])
    return out


def compare(runs: list[tuple[str, str]], systems: set[str] | None = None,
            common: bool = False) -> str:
    tables = [(label, _rows(path, systems)) for label, path in runs]
    base_label, base = tables[0]
    keys = sorted((set.intersection if common else set.union)(*(set(t) for _, t in tables)),
                  key=lambda k: (k[0], k[1], k[3], k[2]))
    head = ["adapters", "rank", "tokens", "system", base_label] + [
        f"{label} (diff)" for label, _ in tables[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = [str(key[0]), str(key[1]), str(key[2]), key[3],
                 f"{base[key]:.1f}" if key in base else "-"]
        for _, table in tables[1:]:
            if key not in table:
                cells.append("-")
            elif key in base:
                cells.append(f"{table[key]:.1f} ({table[key] - base[key]:+.1f})")
            else:
                cells.append(f"{table[key]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--systems", nargs="*", default=None)
    parser.add_argument("--common", action="store_true", help="only rows in every run")
    parser.add_argument("--out", default=None, help="write the table here too")
    args = parser.parse_args()
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            parser.error(f"expected LABEL=PATH, got {item!r}")
        runs.append((label, path))
    table = compare(runs, set(args.systems) if args.systems else None, args.common)
    print(table, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
