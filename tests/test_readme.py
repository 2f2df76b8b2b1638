"""The README's two opening commands, as `.ci/run` reads them, and the dependency digest that
decides when `.ci/run` re-checks the first one in a fresh environment."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_opens_with_the_install_run_and_install_test_commands():
    commands = _script("readme_commands").readme_commands(ROOT / "README.md")
    assert commands == {
        "run": "python -m pip install -e . && dsv41 run",
        "test": 'python -m pip install -e ".[test]" && python -m pytest -q',
    }


def test_ci_prints_exactly_the_readme_command():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_commands.py"), "test"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == 'python -m pip install -e ".[test]" && python -m pytest -q'
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_commands.py"), "lint"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("text, message", [
    ("# x\nno block\n", "no ```bash block"),
    ("```bash\npip install -e .\n```\n", "has 1 commands"),
    ("```bash\na\nb\nc\n```\n", "has 3 commands"),
])
def test_a_readme_without_exactly_two_commands_is_refused(tmp_path, text, message):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(ValueError, match=message):
        _script("readme_commands").readme_commands(readme)


def test_the_digest_follows_what_is_installed_not_tool_settings(tmp_path):
    digest = _script("deps_digest").deps_digest
    base = ('[project]\nname = "x"\ndependencies = ["numpy"]\n'
            '[project.optional-dependencies]\ntest = ["pytest"]\n')
    path = tmp_path / "pyproject.toml"
    path.write_text(base)
    before = digest(path)
    path.write_text(base + "[tool.ruff]\nline-length = 100\n")
    assert digest(path) == before
    path.write_text(base.replace('["numpy"]', '["numpy", "xgboost-cpu"]'))
    assert digest(path) != before
    path.write_text(base.replace('["pytest"]', '["pytest", "ruff"]'))
    assert digest(path) != before


def test_the_install_carries_the_tuners_cost_model():
    """`dsv41 tune` is a verb of the design card: its MetaSchedule needs are plain dependencies,
    not an extra a new user has to know about."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split("=")[0].split("<")[0].split(">")[0].strip() for d in deps}
    assert {"xgboost-cpu", "cloudpickle", "psutil"} <= names
