from importlib.metadata import version

import epilora_rl
from epilora_testing.hygiene import assert_clean_import


def test_version_matches_metadata():
    assert epilora_rl.__version__ == version("epilora-rl")


def test_import_has_no_side_effects():
    assert_clean_import("epilora_rl")
