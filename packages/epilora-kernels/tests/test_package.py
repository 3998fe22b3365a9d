import tomllib
from importlib.metadata import version
from pathlib import Path

import epilora_kernels
from epilora_testing.hygiene import assert_clean_import


def test_version_is_the_one_in_pyproject():
    # One place for the version: pyproject.toml; the package reads its installed metadata, which
    # a stale install would leave behind.
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    want = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert epilora_kernels.__version__ == version("epilora-kernels") == want


def test_import_has_no_side_effects():
    assert_clean_import("epilora_kernels")
