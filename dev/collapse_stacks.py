"""Sum a py-spy profile's collapsed stacks (`py-spy record --format raw`): the share of samples
in each function (inclusive), and in each line at the stack's top (self), over all samples or
only those under a frame whose text contains `--under`.

    python dev/collapse_stacks.py /tmp/spy.txt --under lora_linear_codes --top 40
"""

import argparse
import collections
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--under", default="", help="only stacks through a frame with this text")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = kept = 0
    for line in args.stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        if args.under:
            starts = [i for i, frame in enumerate(frames) if args.under in frame]
            if not starts:
                continue
            frames = frames[starts[0]:]
        kept += samples
        for frame in {frame.rsplit(":", 1)[0] for frame in frames}:  # the function, not line
            inclusive[frame] += samples
        own[frames[-1]] += samples
    print(f"{kept} of {total} samples" + (f" under {args.under!r}" if args.under else ""))
    for title, counter in (("inclusive, by function", inclusive), ("self, by line", own)):
        print(f"\n{title}:")
        for frame, samples in counter.most_common(args.top):
            print(f"{100 * samples / max(kept, 1):6.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main()
