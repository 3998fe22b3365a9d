"""`check_adapter` on the adapters a tenant might bring: each bad kind refused with its reason,
a good one and paths that are vLLM's to resolve let through; `check_adapter_once`'s remembered
verdicts; the server middleware's API-key test, vLLM's."""

import json
from types import SimpleNamespace

import pytest
from adapter_cases import BAD, MAX_RANK, bad_adapter, base_config, good_adapter

from epilora_testing.tiny_models import write_tiny_llama
from epilora_vllm import BadAdapter, check_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("base"))
    return path, base_config(path)


def test_a_good_adapter_and_paths_vllm_resolves_pass(base, tmp_path):
    base_dir, config = base
    check_adapter(good_adapter(tmp_path / "good", base_dir), config, MAX_RANK)
    check_adapter("some-org/some-adapter", config, MAX_RANK)  # a hub id: vLLM's to resolve
    check_adapter("memory://epilora-rl/v3", config, MAX_RANK)  # the RL engine's in-memory one
    check_adapter("", config, MAX_RANK)  # not the working directory


@pytest.mark.parametrize("kind", BAD)
def test_each_bad_adapter_is_refused_with_its_reason(kind, base, tmp_path):
    base_dir, config = base
    path, reason = bad_adapter(kind, tmp_path / kind, base_dir, config)
    with pytest.raises(BadAdapter, match=reason):
        check_adapter(path, config, MAX_RANK)


def test_a_verdict_is_remembered_until_the_adapters_files_change(base, tmp_path, monkeypatch):
    import torch
    from adapter_cases import RANK

    from epilora_testing.tiny_models import write_lora_adapter
    from epilora_vllm import adapter_check

    base_dir, config = base
    reads = []
    read_weights = adapter_check._check_weights
    monkeypatch.setattr(adapter_check, "_check_weights",
                        lambda *a: (reads.append(a[0]), read_weights(*a)))
    monkeypatch.setattr(adapter_check, "_verdicts", type(adapter_check._verdicts)())
    monkeypatch.setattr(adapter_check, "RACY_S", 0.0)  # the files here were just written
    path = good_adapter(tmp_path / "tenant", base_dir)
    for _ in range(3):
        adapter_check.check_adapter_once(path, config, MAX_RANK)
    assert len(reads) == 1
    adapter_check.check_adapter_once(path, config, RANK)  # another engine's limit: its own
    assert len(reads) == 2
    nan = torch.full((RANK, config.hidden_size), float("nan"), dtype=torch.bfloat16)
    write_lora_adapter(path, base_dir, rank=RANK, seed=3, overrides={
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": nan})
    for _ in range(2):  # rewritten: checked again, and the refusal remembered
        with pytest.raises(BadAdapter, match="holds NaN or Inf"):
            adapter_check.check_adapter_once(path, config, MAX_RANK)
    assert len(reads) == 3
    monkeypatch.setattr(adapter_check, "VERDICTS_KEPT", 2)
    others = [good_adapter(tmp_path / f"other-{i}", base_dir) for i in range(2)]
    for other in others:
        adapter_check.check_adapter_once(other, config, MAX_RANK)
    assert len(adapter_check._verdicts) == 2  # the oldest verdicts gone
    with pytest.raises(BadAdapter, match="holds NaN or Inf"):
        adapter_check.check_adapter_once(path, config, MAX_RANK)
    assert len(reads) == 6
    # Files changed within RACY_S of the check: read every time, nothing remembered.
    monkeypatch.setattr(adapter_check, "RACY_S", 3600.0)
    fresh = good_adapter(tmp_path / "fresh", base_dir)
    for _ in range(2):
        adapter_check.check_adapter_once(fresh, config, MAX_RANK)
    assert len(reads) == 8
    # A copy that keeps the modification time (cp -p) is another version: its ctime differs.
    import os
    import shutil

    monkeypatch.setattr(adapter_check, "RACY_S", 0.0)
    copy = shutil.copytree(others[0], tmp_path / "copy")
    adapter_check.check_adapter_once(copy, config, MAX_RANK)
    assert len(reads) == 9
    weights = copy / "adapter_model.safetensors"
    stat = weights.stat()
    shutil.copy2(path / "adapter_model.safetensors", weights)  # the NaN weights, same size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(BadAdapter, match="holds NaN or Inf"):
        adapter_check.check_adapter_once(copy, config, MAX_RANK)


def test_a_home_relative_path_is_checked_as_vllm_reads_it(base, tmp_path, monkeypatch):
    base_dir, config = base
    monkeypatch.setenv("HOME", str(tmp_path))
    bad_adapter("nan", tmp_path / "nan", base_dir, config)
    with pytest.raises(BadAdapter, match="holds NaN or Inf"):
        check_adapter("~/nan", config, MAX_RANK)


def test_good_adapters_of_other_layouts_are_not_refused(base, tmp_path):
    # Names the check does not know (a fused projection, a vision tower's layers, PEFT's
    # adapter name), a lower per-module rank, and a model whose config nests its text model.
    import torch
    from adapter_cases import RANK

    base_dir, config = base
    zeros = torch.zeros(RANK, config.hidden_size, dtype=torch.bfloat16)
    extra = {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": zeros,
             "base_model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight":
                 torch.zeros(RANK, 7, dtype=torch.bfloat16),
             "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight": zeros.clone()}
    check_adapter(good_adapter(tmp_path / "layouts", base_dir, overrides=extra), config,
                  MAX_RANK)
    low = {"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight":
           torch.zeros(2, config.intermediate_size, dtype=torch.bfloat16),
           "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight":
           torch.zeros(config.hidden_size, 2, dtype=torch.bfloat16)}
    path = good_adapter(tmp_path / "pattern", base_dir, overrides=low)
    adapter = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**adapter,
                                                          "rank_pattern": {"down_proj": 2}}))
    check_adapter(path, config, MAX_RANK)
    nested = SimpleNamespace(text_config=config, model_type="llava")
    check_adapter(good_adapter(tmp_path / "nested", base_dir), nested, MAX_RANK)
    with pytest.raises(BadAdapter, match="another base model"):  # still checked when nested
        wide = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                torch.zeros(RANK, config.hidden_size * 2, dtype=torch.bfloat16)}
        check_adapter(good_adapter(tmp_path / "wide", base_dir, overrides=wide), nested,
                      MAX_RANK)


def _adapter_from_modules(directory, model, rank=4):
    # A PEFT adapter of every attention and MLP projection of `model` (a transformers model on
    # the meta device), its shapes taken from the model's own modules: what PEFT would write.
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA",
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]}))
    tensors = {}
    for name, module in model.named_modules():
        if (name.split(".")[-1] in {"q_proj", "o_proj", "gate_proj", "down_proj"}
                and isinstance(module, torch.nn.Linear)):
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, module.in_features)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(module.out_features, rank)
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory, tensors


@pytest.mark.parametrize("kind", ["gated attention (Qwen3-Next)", "MLA (DeepSeek-V2)"])
def test_adapters_of_layouts_unlike_llamas_are_checked_by_the_models_own_modules(
        kind, tmp_path):
    # The shapes come from transformers' modeling code, built on the meta device: a q_proj
    # twice the heads wide (gated attention), MLA's heads of their own widths, layers of
    # several kinds. Such a model's own adapter passes; one layer's A made wider is refused.
    import torch
    import transformers
    from safetensors.torch import save_file

    if kind.startswith("gated"):
        config = transformers.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=128)
    else:
        config = transformers.DeepseekV2Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=128)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    path, tensors = _adapter_from_modules(tmp_path / "own", model)
    assert any(name.endswith("q_proj.lora_B.weight") for name in tensors)
    check_adapter(path, config, MAX_RANK)
    name = next(name for name in tensors if name.endswith("o_proj.lora_A.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 8)
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(BadAdapter, match="another base model"):
        check_adapter(path, config, MAX_RANK)


@pytest.mark.parametrize("header, let_through", [
    ("Bearer key-1", True), ("bearer key-1", True), ("BEARER key-2", True),
    ("Bearer key-3", False), ("Basic key-1", False), ("key-1", False), (None, False)])
def test_adapters_are_looked_at_only_for_callers_vllms_key_check_lets_through(
        header, let_through, monkeypatch):
    # vLLM's own test (AuthenticationMiddleware.verify_token): any case of the scheme, the
    # token after the first space, any of the keys.
    from epilora_vllm.adapter_check import _authorized

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    headers = {} if header is None else {"authorization": header}
    request = SimpleNamespace(headers=headers, app=SimpleNamespace(state=SimpleNamespace(
        args=SimpleNamespace(api_key=["key-1", "key-2"]))))
    assert _authorized(request) == let_through
    request.app.state.args.api_key = None  # no key: everyone
    assert _authorized(request)
    # VLLM_API_KEY counts only without a CLI key (vLLM's server: the CLI's replaces it).
    monkeypatch.setenv("VLLM_API_KEY", "key-env")
    request.headers["authorization"] = "Bearer key-env"
    assert _authorized(request)
    request.app.state.args.api_key = ["key-1"]
    assert not _authorized(request)


def test_the_engines_check_leaves_tensorizer_adapters_and_engines_without_lora_to_vllm(
        base, tmp_path):
    from epilora_vllm import request_check

    base_dir, config = base
    path, reason = bad_adapter("nan", tmp_path / "nan", base_dir, config)
    engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=config),
                             lora_config=SimpleNamespace(max_lora_rank=MAX_RANK))
    with pytest.raises(BadAdapter, match=reason):
        request_check._check(engine, SimpleNamespace(lora_path=str(path)))
    # vLLM reads a tensorizer adapter's weights from its tensorizer_dir, not lora_path
    request_check._check(engine, SimpleNamespace(lora_path=str(path), tensorizer_config_dict={
        "tensorizer_dir": str(tmp_path / "elsewhere")}))
    request_check._check(engine, None)
    request_check._check(SimpleNamespace(lora_config=None), SimpleNamespace(lora_path=str(path)))
