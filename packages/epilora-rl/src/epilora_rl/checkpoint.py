"""A run's files, each written whole or not at all (a temporary name, then a rename), so that a
kill at any moment leaves the previous step's complete state:

    out_dir/adapters/step-<n>/   adapter_model.safetensors + adapter_config.json (PEFT's
                                 format, bf16: vLLM loads it as it is, with or without the plugin)
    out_dir/state.pt             the last finished step: adapter (fp32 master), optimizer,
                                 step records, the config it ran with
    out_dir/steps.jsonl          one line per finished step (rewritten from the state)
"""

import json
import os
import shutil
from pathlib import Path

import torch

STATE = "state.pt"
STEPS = "steps.jsonl"


def adapter_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "adapters" / f"step-{step}"


def save_adapter(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()},
              tmp / "adapter_model.safetensors")
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(path, ignore_errors=True)  # a step re-run after a kill writes it again
    os.replace(tmp, path)
    return path


def save_state(out_dir: Path, state: dict) -> None:
    path = Path(out_dir) / STATE
    tmp = path.with_name(STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    lines = "".join(json.dumps(r) + "\n" for r in state["records"])
    steps_tmp = Path(out_dir) / (STEPS + ".tmp")
    steps_tmp.write_text(lines)
    os.replace(steps_tmp, Path(out_dir) / STEPS)


def load_state(out_dir: Path) -> dict | None:
    path = Path(out_dir) / STATE
    return torch.load(path, weights_only=False) if path.exists() else None
