import pytest

from epilora_testing.hygiene import assert_clean_import


def test_a_clean_module_passes():
    assert_clean_import("epilora_testing.assertions")


def test_a_forbidden_import_is_reported():
    with pytest.raises(AssertionError, match="imported"):
        assert_clean_import("json", forbidden=("json",))
