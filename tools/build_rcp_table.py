"""Build epilora-quant's table of the GPU's approximate fp32 reciprocal from a probe result.

Input: the JSON of dev/probe_gpu_division.py (run on the GPU). Output:

* `packages/epilora-quant/src/epilora_quant/data/rcp_approx_sm90.bin.xz`: two bitmaps over the
  2^23 fp32 mantissas (LSB-first bit order, numpy `packbits(bitorder="little")`), first the
  mantissas whose approximate reciprocal is 1 ulp below the correctly rounded one, then those 1 ulp
  above; xz-compressed.
* a summary JSON (counts, device, versions, the table's sha256) for benchmarks/results/.

    python tools/build_rcp_table.py PROBE.json --summary benchmarks/results/h200/gpu_division.json

`--check SUMMARY` instead checks that the shipped table is the one a committed summary describes
(its sha256 and ulp counts), e.g. `--check benchmarks/results/h200/gpu_division.json`.
"""

import argparse
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np

TABLE = Path(__file__).parents[1] / "packages/epilora-quant/src/epilora_quant/data"
MANTISSAS = 1 << 23


def check(summary_path: str) -> None:
    summary = json.loads(Path(summary_path).read_text())
    raw = lzma.decompress((TABLE / "rcp_approx_sm90.bin.xz").read_bytes())
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    minus, plus = bits.reshape(2, MANTISSAS).astype(bool)
    got = {"sha256_uncompressed": hashlib.sha256(raw).hexdigest(),
           "minus_one_ulp": int(minus.sum()), "plus_one_ulp": int(plus.sum())}
    want = {key: summary["table"][key] for key in got}
    errors = [f"{key}: table {got[key]}, summary {want[key]}" for key in got
              if got[key] != want[key]]
    if (minus & plus).any():
        errors.append("a mantissa in both bitmaps")
    if got["minus_one_ulp"] + got["plus_one_ulp"] != summary["reciprocal_mantissas_differing"]:
        errors.append("the counts do not add up to reciprocal_mantissas_differing")
    if errors:
        raise SystemExit(f"{summary_path} does not describe the shipped table: {errors}")
    print(f"the shipped table is the one {summary_path} describes: {got}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("probe", nargs="?")
    parser.add_argument("--summary")
    parser.add_argument("--check", metavar="SUMMARY")
    args = parser.parse_args()
    if args.check:
        return check(args.check)
    if not (args.probe and args.summary):
        parser.error("PROBE and --summary are required (or --check SUMMARY)")
    probe = json.loads(Path(args.probe).read_text())
    mantissas = np.asarray(probe["reciprocal_differing_mantissas"], dtype=np.int64)
    ulps = np.asarray(probe["reciprocal_differing_ulp"], dtype=np.int64)
    if not set(np.unique(ulps).tolist()) <= {-1, 1}:
        raise SystemExit(f"unexpected ulp differences {np.unique(ulps)}: the table holds +-1 only")
    bitmaps = []
    for delta in (-1, 1):
        bits = np.zeros(MANTISSAS, dtype=bool)
        bits[mantissas[ulps == delta]] = True
        bitmaps.append(np.packbits(bits, bitorder="little"))
    raw = np.concatenate(bitmaps).tobytes()
    TABLE.mkdir(parents=True, exist_ok=True)
    path = TABLE / "rcp_approx_sm90.bin.xz"
    path.write_bytes(lzma.compress(raw, preset=9))
    summary = {k: v for k, v in probe.items() if not k.startswith("reciprocal_differing")}
    summary["table"] = {"file": str(path.relative_to(TABLE.parents[4])),
                        "sha256_uncompressed": hashlib.sha256(raw).hexdigest(),
                        "minus_one_ulp": int((ulps == -1).sum()),
                        "plus_one_ulp": int((ulps == 1).sum())}
    summary["command"] = "python3 dev/probe_gpu_division.py --out PROBE.json (H200), then " \
                         "python tools/build_rcp_table.py PROBE.json --summary ..."
    Path(args.summary).write_text(json.dumps(summary, indent=1))
    print(f"{path}: {path.stat().st_size} bytes; {summary['table']}")


if __name__ == "__main__":
    main()
