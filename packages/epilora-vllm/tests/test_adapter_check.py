"""`check_adapter` on the adapters a tenant might bring: each bad kind refused with its reason,
a good one and paths that are vLLM's to resolve let through."""

import json
from types import SimpleNamespace

import pytest
from adapter_cases import BAD, MAX_RANK, bad_adapter, good_adapter

from epilora_testing.tiny_models import write_tiny_llama
from epilora_vllm import BadAdapter, check_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("base"))
    return path, SimpleNamespace(**json.loads((path / "config.json").read_text()))


def test_a_good_adapter_and_paths_vllm_resolves_pass(base, tmp_path):
    base_dir, config = base
    check_adapter(good_adapter(tmp_path / "good", base_dir), config, MAX_RANK)
    check_adapter("some-org/some-adapter", config, MAX_RANK)  # a hub id: vLLM's to resolve


@pytest.mark.parametrize("kind", BAD)
def test_each_bad_adapter_is_refused_with_its_reason(kind, base, tmp_path):
    base_dir, config = base
    path, reason = bad_adapter(kind, tmp_path / kind, base_dir, config)
    with pytest.raises(BadAdapter, match=reason):
        check_adapter(path, config, MAX_RANK)
