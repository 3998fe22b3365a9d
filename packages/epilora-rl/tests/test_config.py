"""A run's settings checked before anything is loaded: the values TRL's habits or a typo give,
refused with the key and the reason, and the engine mode against the checkpoint's kind."""

import json

import pytest

from epilora_rl.config import config_from_dict


def _config(tmp_path, quantized=None, **sections):
    model = {"path": str(tmp_path / "no-such-model")}
    if quantized is not None:  # a checkpoint's config.json, FP8 (quantization_config) or not
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(
            {"model_type": "llama", **({"quantization_config": {"quant_method": "fp8"}}
                                       if quantized else {})}))
        model["path"] = str(tmp_path / "ckpt")
    data = {"model": model, "grpo": {"prompts_per_step": 2, "group_size": 4,
                                     "micro_batch_size": 4}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


@pytest.mark.parametrize("section, values, message", [
    ("run", {"steps": 2.5}, r"\[run\] steps = 2.5: must be a positive integer"),
    ("grpo", {"prompts_per_step": 2.0}, "prompts_per_step = 2.0: must be a positive integer"),
    ("task", {"eval_size": 1.5}, "eval_size = 1.5: must be a positive integer or 0"),
    ("grpo", {"temperature": 0.0}, r"\[grpo\] temperature = 0.0: must be a positive number$"),
    ("optim", {"max_grad_norm": -1.0}, "max_grad_norm = -1.0: must be a positive number or 0"),
    ("grpo", {"micro_batch_size": 3}, "micro_batch_size = 3 must divide the step's 8 rollouts"),
])
def test_bad_values_are_refused_with_the_key_and_why(tmp_path, section, values, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **{section: values})


def test_a_max_grad_norm_of_zero_is_no_clipping_as_in_transformers(tmp_path):
    assert _config(tmp_path, optim={"max_grad_norm": 0.0}).optim.max_grad_norm == 0.0


def test_the_engine_mode_must_fit_the_checkpoints_kind(tmp_path):
    with pytest.raises(ValueError, match="mode = 'bf16' with an FP8 checkpoint"):
        _config(tmp_path, quantized=True, engine={"mode": "bf16"})
    for mode in ("matched", "w8a8"):
        with pytest.raises(ValueError, match=f"mode = '{mode}' computes an FP8 base"):
            _config(tmp_path, quantized=False, engine={"mode": mode})
    _config(tmp_path, quantized=False, engine={"mode": "matched"},
            model={"quantization": "fp8"})  # vLLM's online FP8
    _config(tmp_path, quantized=True, engine={"mode": "matched"})
    _config(tmp_path, quantized=False, engine={"mode": "bf16"})
