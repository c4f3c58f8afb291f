"""The README's usage example runs as written and does what it says."""

import re
from pathlib import Path


def test_readme_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["probs"].grad.dtype.is_floating_point
    assert scope["y"].shape == (10, 64)


def test_readme_recipe_accumulation_and_moe_examples_run():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4  # the recipe, gradient-accumulation and MoE examples
    for block in blocks[1:]:
        exec(compile(block, "README.md", "exec"), {})
