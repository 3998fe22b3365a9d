"""The table of the GPU's approximate reciprocal: integrity and the properties measured with it.

That the table reproduces the GPU is checked on the H200 (tests/gpu/); here: it is the table the
H200 probe measured, it moves results by at most one ulp, in the same way in every binade, and it
refuses inputs outside the range it was measured on. (That the committed probe summary,
benchmarks/results/h200/gpu_division.json, describes this table is checked by
`python tools/build_rcp_table.py --check benchmarks/results/h200/gpu_division.json`.)
"""

import hashlib
import lzma
from importlib import resources

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from epilora_quant.gpu_reciprocal import _ulp_adjustment, triton_reciprocal_sm90

MANTISSAS = 1 << 23
# The table built from the H200 probe (dev/probe_gpu_division.py, then tools/build_rcp_table.py;
# its summary: benchmarks/results/h200/gpu_division.json): the uncompressed bitmaps' sha256 and
# how many of the 2^23 mantissas get -1 and +1 ulp.
SHA256 = "c44f42540f9128190cea8ccb62e2549cec959fb0b8193efbd21d106c5ede8204"
MINUS_ONE_ULP, PLUS_ONE_ULP = 374723, 733799


def test_table_is_the_one_the_h200_probe_measured():
    raw = lzma.decompress(
        resources.files("epilora_quant").joinpath("data/rcp_approx_sm90.bin.xz").read_bytes()
    )
    assert hashlib.sha256(raw).hexdigest() == SHA256
    assert len(raw) == 2 * MANTISSAS // 8  # the -1 bitmap, then the +1 bitmap
    minus, plus = raw[: MANTISSAS // 8], raw[MANTISSAS // 8 :]
    assert int.from_bytes(minus, "little") & int.from_bytes(plus, "little") == 0  # none in both
    table = _ulp_adjustment()
    assert table.shape == (MANTISSAS,)
    assert int((table == -1).sum()) == MINUS_ONE_ULP
    assert int((table == 1).sum()) == PLUS_ONE_ULP
    assert int((table == 0).sum()) == MANTISSAS - MINUS_ONE_ULP - PLUS_ONE_ULP
    assert int(table[0]) == 0  # 1 / 1.0 is exact (so are the powers of two, below)


@given(
    st.floats(min_value=2.0**-126, max_value=2.0**126, exclude_max=True, width=32), st.booleans()
)
@example(1.0, False)
@example(2.0**-126, True)
@example(2.0**125, False)
@example(float.fromhex("0x1.fffffep125"), False)
def test_within_one_ulp_of_the_rounded_reciprocal_and_binade_invariant(value, negative):
    b = torch.tensor([-value if negative else value], dtype=torch.float32)
    r = triton_reciprocal_sm90(b)
    exact = torch.reciprocal(b)
    assert abs(int(r.view(torch.int32)) - int(exact.view(torch.int32))) <= 1
    # b = m * 2^e with m in [1, 2) of b's sign. In the measured range 1/b and 1/m are normal, so
    # the rounded 1/b is the rounded 1/m times 2^-e, and the table, indexed by the mantissa,
    # adds the same ulp to both: r(b) is r(m) times 2^-e exactly, i.e. its bits are r(m)'s with
    # the exponent field lowered by e.
    bits = int(b.view(torch.int32))
    e = ((bits >> 23) & 0xFF) - 127
    m_bits = (bits & ~0x7F800000) | 0x3F800000  # b's sign and mantissa bits, exponent 0
    m = torch.tensor([m_bits], dtype=torch.int32).view(torch.float32)
    r_m = triton_reciprocal_sm90(m)
    assert int(r.view(torch.int32)) == int(r_m.view(torch.int32)) - (e << 23)
    if bits & 0x7FFFFF == 0:  # b = +-2^e: its reciprocal +-2^-e is exact, mantissa bits zero
        assert int(r.view(torch.int32)) & 0x7FFFFF == 0
        assert bool(r == exact) and r.item() == (-1.0 if negative else 1.0) * 2.0**-e


def test_every_power_of_two_in_the_range_has_its_exact_reciprocal():
    e = torch.arange(-126, 126, dtype=torch.float64)
    b = torch.cat([2.0**e, -(2.0**e)]).to(torch.float32)
    r = triton_reciprocal_sm90(b)
    assert bool((r.view(torch.int32) & 0x7FFFFF == 0).all())
    assert bool((r.double() == torch.cat([2.0**-e, -(2.0**-e)])).all())


def test_e4m3_values_have_exact_reciprocals():
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert bool((triton_reciprocal_sm90(e4m3) == torch.reciprocal(e4m3)).all())


@pytest.mark.parametrize("bad", [0.0, 2.0**-127, 2.0**126, float("inf")])
def test_outside_the_measured_range_is_refused(bad):
    with pytest.raises(ValueError, match="exact only for"):
        triton_reciprocal_sm90(torch.tensor([bad], dtype=torch.float32))
