"""The table of the GPU's approximate reciprocal: integrity and the properties measured with it.

That the table reproduces the GPU is checked on the H200 (tests/gpu/); here: it is the table the
committed probe summary describes, it moves results by at most one ulp, and it refuses inputs
outside the range it was measured on.
"""

import hashlib
import json
import lzma
from importlib import resources
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epilora_quant.gpu_reciprocal import _ulp_adjustment, triton_reciprocal_sm90

SUMMARY = Path(__file__).parents[3] / "benchmarks/results/h200/gpu_division.json"


def test_table_is_the_one_the_probe_summary_describes():
    summary = json.loads(SUMMARY.read_text())
    raw = lzma.decompress(
        resources.files("epilora_quant").joinpath("data/rcp_approx_sm90.bin.xz").read_bytes()
    )
    assert hashlib.sha256(raw).hexdigest() == summary["table"]["sha256_uncompressed"]
    table = _ulp_adjustment()
    assert table.shape == (1 << 23,)
    assert int((table == -1).sum()) == summary["table"]["minus_one_ulp"]
    assert int((table == 1).sum()) == summary["table"]["plus_one_ulp"]
    assert (
        int((table == -1).sum() + (table == 1).sum()) == summary["reciprocal_mantissas_differing"]
    )


@given(
    st.floats(min_value=2.0**-126, max_value=2.0**126, exclude_max=True, width=32), st.booleans()
)
def test_within_one_ulp_of_the_rounded_reciprocal_and_binade_invariant(value, negative):
    b = torch.tensor([-value if negative else value], dtype=torch.float32)
    r = triton_reciprocal_sm90(b)
    exact = torch.reciprocal(b)
    assert abs(int(r.view(torch.int32)) - int(exact.view(torch.int32))) <= 1
    mantissa_twin = (b.view(torch.int32) & 0x807FFFFF | 0x3F800000).view(torch.float32)
    twin = triton_reciprocal_sm90(mantissa_twin)  # same mantissa in [1, 2)
    assert int(r.view(torch.int32) & 0x7FFFFF) == int(twin.view(torch.int32) & 0x7FFFFF) or bool(
        torch.reciprocal(mantissa_twin) == 1.0 / mantissa_twin
    )  # exact powers of two


def test_e4m3_values_have_exact_reciprocals():
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert bool((triton_reciprocal_sm90(e4m3) == torch.reciprocal(e4m3)).all())


@pytest.mark.parametrize("bad", [0.0, 2.0**-127, 2.0**126, float("inf")])
def test_outside_the_measured_range_is_refused(bad):
    with pytest.raises(ValueError, match="exact only for"):
        triton_reciprocal_sm90(torch.tensor([bad], dtype=torch.float32))
