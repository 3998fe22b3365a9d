"""docs/kernels-api.md's example (a downstream engine, SGLang's LoRA batch layout, calling the
public API) runs as written: its Python blocks executed in order, in one namespace, in Triton's
interpreter. The page lives outside the package; this test reads it from the checkout and is
skipped in an installed copy that has no docs."""

from pathlib import Path

import pytest

PAGE = Path(__file__).parents[3] / "docs" / "kernels-api.md"


def _blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_engine_example_on_the_api_page_runs(capsys):
    if not PAGE.is_file():
        pytest.skip("docs/ is not part of an installed package")
    blocks = _blocks(PAGE.read_text())
    assert len(blocks) >= 5, "the page's example blocks"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102
    assert namespace["y"].shape == (6, 96)
    assert "relative error against the SGLang-layout reference" in capsys.readouterr().out
