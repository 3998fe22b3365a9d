from importlib.metadata import version

import epilora_kernels
from epilora_testing.hygiene import assert_clean_import


def test_version_matches_metadata():
    assert epilora_kernels.__version__ == version("epilora-kernels")


def test_import_has_no_side_effects():
    assert_clean_import("epilora_kernels")
