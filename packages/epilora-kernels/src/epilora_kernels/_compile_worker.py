"""A worker process of the tuner's parallel compile (`tuner._compile_in_parallel`):

    python -m epilora_kernels._compile_worker SHARE.json ERRORS.json

runs its share of the tuner's launches once each (`tuner._compile`), so that Triton compiles
them into its disk cache, where the tuning process then finds them; writes the failures, as
text, to ERRORS.json. The share: {"device", "rank", "slots", "codes", "launches": [[K, slices,
tokens, K1's LaunchConfig fields, K2's], ...]}.
"""

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import torch

    from epilora_kernels.launch import LaunchConfig
    from epilora_kernels.tuner import _compile

    share_path, errors_path = argv
    share = json.loads(Path(share_path).read_text())
    device = torch.device(share["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launches = [(k, tuple(slices), t, LaunchConfig(**k1), LaunchConfig(**k2))
                for k, slices, t, k1, k2 in share["launches"]]
    errors = _compile(launches, share["rank"], share["slots"], share["codes"], device)
    Path(errors_path).write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1:])
