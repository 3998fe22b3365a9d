from importlib.metadata import version

import epilora_vllm
from epilora_testing.hygiene import assert_clean_import


def test_version_matches_metadata():
    assert epilora_vllm.__version__ == version("epilora-vllm")


def test_import_has_no_side_effects():
    assert_clean_import("epilora_vllm")
