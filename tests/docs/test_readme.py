import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_quickstart_runs_and_is_right(capsys):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README quickstart", "exec"), namespace)
    value = float(namespace["value"].to_array(np.float32))
    np.testing.assert_allclose(value, (0.25 + 0.140625) * 2.0**-40, rtol=1e-3)
    assert "ScaledArray" in capsys.readouterr().out


def test_readme_set_up_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "python -m pytest -q -n 2 tests"
    assert test_command in readme and test_command in ci
    slow_command = "python -m pytest -q -n 2 -m slow tests"
    assert slow_command in readme and slow_command in ci
    assert 'pip install -e ".[test,dev]"' in readme and 'pip install --quiet -e ".[test,dev]"' in ci
