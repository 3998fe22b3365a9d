from epilora_testing.hygiene import assert_clean_import


def test_import_touches_neither_triton_vllm_nor_cuda():
    assert_clean_import("epilora_quant")
