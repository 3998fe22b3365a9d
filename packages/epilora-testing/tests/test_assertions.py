import pytest
import torch

from epilora_testing import assert_bitwise_equal


def test_equal_tensors_pass():
    x = torch.tensor([1.0, -0.0, 3.5], dtype=torch.bfloat16)
    assert_bitwise_equal(x, x.clone())


def test_signed_zero_is_a_mismatch_reported_in_hex():
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]), name="y")
    message = str(info.value)
    assert "y: 1 of 2 elements differ bitwise" in message
    assert "got 0x00000000 (0.0), want 0x80000000 (-0.0)" in message


def test_nan_payloads_differ():
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    with pytest.raises(AssertionError, match="0x7fc00001"):
        assert_bitwise_equal(a, b)


def test_fp8_codes_report_and_input_context():
    got = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
    want = torch.tensor([[1.0, 2.25]]).to(torch.float8_e4m3fn)
    inputs = torch.tensor([[1.0, 2.2]], dtype=torch.bfloat16)
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(got, want, name="codes", inputs=inputs)
    assert "at (0, 1): got 0x40 (2.0), want 0x41 (2.25), input 0x400d" in str(info.value)


@pytest.mark.parametrize(
    ("got", "want", "message"),
    [
        (torch.zeros(2), torch.zeros(3), "shape"),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float16), "dtype"),
    ],
)
def test_shape_and_dtype_must_agree(got, want, message):
    with pytest.raises(AssertionError, match=message):
        assert_bitwise_equal(got, want)


def test_report_is_capped():
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(torch.zeros(100), torch.ones(100), max_report=3)
    assert str(info.value).count("\n  at ") == 3
