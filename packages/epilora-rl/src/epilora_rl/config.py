"""A training run's settings: one TOML file (`epilora-rl train --config run.toml`), checked whole
before anything is loaded, so a bad value costs no GPU time.

    [model]
    path = "models/smollm2-fp8"   # an FP8 checkpoint (epilora-fp8-checkpoint), or a bf16 one
    quantization = "fp8"          # with a bf16 checkpoint: vLLM's online FP8 (GPU only)

    [engine]                      # the in-process vLLM engine that makes the rollouts
    mode = "matched"              # matched (W8A16, no correction) | w8a8 (vLLM FP8 + TIS) |
                                  # bf16 (a bf16 checkpoint, engine and trainer: the reference)
    gpu_memory_utilization = 0.4
    max_model_len = 1024

    [lora]
    rank = 16
    alpha = 32

    [task]
    name = "basic_arithmetic"     # a reasoning-gym dataset, or `even_tokens` (smoke tests)
    answer = "last_number"        # the first line's last number (default: the whole line)

    [grpo]
    prompts_per_step = 8
    group_size = 8
    max_completion_tokens = 64

    [optim]
    lr = 1e-4

    [run]
    steps = 50
    out_dir = "runs/arith"

Every key and its default is a field below; unknown keys are errors.
"""

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from epilora_rl.grpo import GrpoLoss
from epilora_rl.model import PROJECTIONS
from epilora_rl.tasks import ANSWER_FORMATS

ENGINE_MODES = ("matched", "w8a8", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    quantization: str | None = None  # "fp8": vLLM quantizes a bf16 checkpoint online


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "matched"
    gpu_memory_utilization: float = 0.4
    max_model_len: int = 1024
    kv_cache_memory_bytes: int | None = None  # instead of gpu_memory_utilization (CPU)
    enforce_eager: bool = False
    # Free the engine's KV cache while the trainer runs, the shared weights staying (GPU only:
    # epilora_rl.kv_release).
    release_kv_cache: bool = False


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = PROJECTIONS


@dataclass(frozen=True)
class TaskConfig:
    name: str = "basic_arithmetic"
    options: dict = field(default_factory=dict)  # the task's own settings (reasoning-gym's)
    answer: str = "first_line"  # where the answer is read: epilora_rl.tasks.ANSWER_FORMATS
    eval_size: int = 64  # held-out prompts, greedy, before and after training


@dataclass(frozen=True)
class GrpoConfig:
    prompts_per_step: int = 8
    group_size: int = 8
    max_completion_tokens: int = 64
    temperature: float = 1.0
    micro_batch_size: int = 8  # sequences per trainer forward (gradient accumulation)
    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # KL to the base (the adapter off) per token
    tis_cap: float | None = None  # default: 2 with mode = "w8a8", none when matched


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class RunSettings:
    steps: int = 10
    out_dir: str = "runs/epilora-rl"
    seed: int = 0


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunSettings = field(default_factory=RunSettings)

    def loss(self) -> GrpoLoss:
        g = self.grpo
        cap = g.tis_cap if g.tis_cap is not None else (2.0 if self.engine.mode == "w8a8" else None)
        return GrpoLoss(loss_type=g.loss_type, epsilon_low=g.epsilon_low,
                        epsilon_high=g.epsilon_high, beta=g.beta, tis_cap=cap,
                        max_completion_length=g.max_completion_tokens)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _section(cls, name: str, values: dict):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"[{name}]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    out = {}
    for key, value in values.items():
        if key in ("target_modules", "betas"):
            value = tuple(value)
        out[key] = value
    return cls(**out)


def config_from_dict(data: dict) -> RunConfig:
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    unknown = set(data) - set(sections)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; known: {sorted(sections)}")
    defaults = RunConfig()
    config = RunConfig(**{name: _section(type(getattr(defaults, name)), name, data[name])
                          for name in sections if name in data})
    validate(config)
    return config


def load_config(path: str | Path) -> RunConfig:
    """The run's settings from a TOML file, checked (`ValueError` says which key and why)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no config file at {path}")
    with path.open("rb") as f:
        return config_from_dict(tomllib.load(f))


def _positive(name: str, value, *, allow_zero: bool = False, integer: bool = False) -> None:
    kinds = int if integer else int | float
    if not isinstance(value, kinds) or isinstance(value, bool) or value < 0 or (
            value == 0 and not allow_zero):
        raise ValueError(f"{name} = {value!r}: must be a positive "
                         f"{'integer' if integer else 'number'}"
                         f"{' or 0' if allow_zero else ''}")


def _fp8_checkpoint(path: str) -> bool | None:
    """Whether the checkpoint at `path` is quantized (its config.json has a
    quantization_config: an FP8 one here), or None where no config.json is there to read."""
    config = Path(path) / "config.json"
    try:
        return "quantization_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return None


def validate(c: RunConfig) -> None:
    if not c.model.path:
        raise ValueError("[model] path is required")
    if c.model.quantization not in (None, "fp8"):
        raise ValueError(f"[model] quantization = {c.model.quantization!r}: null or 'fp8'")
    if c.engine.mode not in ENGINE_MODES:
        raise ValueError(f"[engine] mode = {c.engine.mode!r}: one of {ENGINE_MODES}")
    if c.engine.mode == "bf16" and c.model.quantization is not None:
        raise ValueError("[engine] mode = 'bf16' computes the checkpoint as it is: leave [model] "
                         "quantization unset (and give a bf16 checkpoint)")
    fp8_checkpoint = _fp8_checkpoint(c.model.path)
    if c.engine.mode == "bf16" and fp8_checkpoint:
        raise ValueError(f"[engine] mode = 'bf16' with an FP8 checkpoint ({c.model.path}): the "
                         "engine would sample from FP8 weights and the trainer compute on them, "
                         "with no correction; give a bf16 checkpoint, or mode = 'matched'")
    if (c.engine.mode != "bf16" and fp8_checkpoint is False
            and c.model.quantization is None):
        raise ValueError(f"[engine] mode = {c.engine.mode!r} computes an FP8 base, and "
                         f"{c.model.path} is a bf16 checkpoint: set [model] quantization = "
                         "'fp8' (vLLM's online FP8, GPU only), give an FP8 checkpoint "
                         "(epilora-fp8-checkpoint), or mode = 'bf16'")
    if not 0 < c.engine.gpu_memory_utilization < 1:
        raise ValueError(f"[engine] gpu_memory_utilization = {c.engine.gpu_memory_utilization}:"
                         " between 0 and 1")
    for name, value in (("[engine] max_model_len", c.engine.max_model_len),
                        ("[lora] rank", c.lora.rank),
                        ("[grpo] prompts_per_step", c.grpo.prompts_per_step),
                        ("[grpo] max_completion_tokens", c.grpo.max_completion_tokens),
                        ("[grpo] micro_batch_size", c.grpo.micro_batch_size),
                        ("[run] steps", c.run.steps)):
        _positive(name, value, integer=True)
    _positive("[task] eval_size", c.task.eval_size, allow_zero=True, integer=True)
    # Above 0; the temperature too: a group's samples must differ (vLLM refuses several greedy
    # samples of a prompt, and only once the engine is up).
    for name, value in (("[lora] alpha", c.lora.alpha), ("[optim] lr", c.optim.lr),
                        ("[grpo] temperature", c.grpo.temperature)):
        _positive(name, value)
    # 0: no clipping, as transformers' Trainer takes it (a negative norm would flip the
    # gradient).
    _positive("[optim] max_grad_norm", c.optim.max_grad_norm, allow_zero=True)
    if not isinstance(c.grpo.group_size, int) or c.grpo.group_size < 2:
        raise ValueError(f"[grpo] group_size = {c.grpo.group_size!r}: at least 2 (advantages "
                         "compare samples of one prompt)")
    rollouts = c.grpo.prompts_per_step * c.grpo.group_size
    if rollouts % c.grpo.micro_batch_size:
        # Each micro-batch's loss is its own mean, weighted 1 / micro-batches: a shorter last
        # one would weigh its samples more (TRL asks the same divisibility).
        raise ValueError(f"[grpo] micro_batch_size = {c.grpo.micro_batch_size} must divide the "
                         f"step's {rollouts} rollouts (prompts_per_step x group_size)")
    if c.lora.rank > 128:
        raise ValueError(f"[lora] rank = {c.lora.rank}: ranks up to 128 are served")
    if c.task.answer not in ANSWER_FORMATS:
        raise ValueError(f"[task] answer = {c.task.answer!r}: one of {ANSWER_FORMATS}")
    unknown = set(c.lora.target_modules) - set(PROJECTIONS)
    if unknown or not c.lora.target_modules:
        raise ValueError(f"[lora] target_modules {list(c.lora.target_modules)}: a non-empty "
                         f"subset of {list(PROJECTIONS)}")
    if c.optim.weight_decay < 0 or not all(0 <= b < 1 for b in c.optim.betas):
        raise ValueError("[optim] weight_decay >= 0 and betas in [0, 1) expected")
    c.loss()  # GrpoLoss checks its own settings
