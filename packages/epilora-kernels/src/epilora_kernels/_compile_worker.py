"""A worker process of the tuner's parallel compile (`tuner._compile_in_parallel`):

    python -m epilora_kernels._compile_worker SHARE.json ERRORS.json [PROGRESS.json]

runs its share of the tuner's launches once each (`tuner._compile`), so that Triton compiles
them into its disk cache, where the tuning process then finds them; writes the failures, as
text, to ERRORS.json. The share: {"device", "rank", "slots", "codes", "launches": [[K, slices,
tokens, K1's LaunchConfig fields, K2's], ...]}. PROGRESS.json, rewritten before each launch
and once after the last: {"index", "of", "time", "launch"} (index == of: all begun), so that a
worker stopped at the tuner's budget says where.
"""

import json
import os
import sys
import time
from pathlib import Path


def write_progress(path: Path, index: int, total: int, launch: tuple | None) -> None:
    """PROGRESS.json: launch `index` of `total` begins now (None: all have). Written whole,
    then renamed, so that the tuner never reads half a file; a failed write loses the
    progress, not the compile."""
    from epilora_kernels.tuner import launch_text

    said = "" if launch is None else launch_text(launch)
    part = path.with_suffix(".part")
    try:
        part.write_text(json.dumps({"index": index, "of": total, "time": time.time(),
                                    "launch": said}))
        os.replace(part, path)
    except OSError:
        pass


def main(argv: list[str]) -> None:
    import torch

    from epilora_kernels.launch import LaunchConfig
    from epilora_kernels.tuner import _compile

    share_path, errors_path, *progress_path = argv
    share = json.loads(Path(share_path).read_text())
    device = torch.device(share["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launches = [(k, tuple(slices), t, LaunchConfig(**k1), LaunchConfig(**k2))
                for k, slices, t, k1, k2 in share["launches"]]
    started = None
    if progress_path:
        def started(index, launch):
            write_progress(Path(progress_path[0]), index, len(launches), launch)

    errors = _compile(launches, share["rank"], share["slots"], share["codes"], device, started)
    if started is not None:
        started(len(launches), None)
    Path(errors_path).write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1:])
