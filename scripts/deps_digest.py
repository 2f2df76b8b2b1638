"""Print a digest of what pyproject.toml installs (build system, Python, dependencies, extras).

`.ci/run` checks the README's first command in a fresh environment whenever this digest differs
from the one recorded in `.ci/run-check.sha256` by the last successful check.
"""

import hashlib
import json
import tomllib
from pathlib import Path


def deps_digest(pyproject: Path) -> str:
    data = tomllib.loads(pyproject.read_text())
    project = data.get("project", {})
    installs = {
        "build-system": data.get("build-system", {}),
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "scripts": project.get("scripts", {}),
    }
    return hashlib.sha256(json.dumps(installs, sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    print(deps_digest(Path(__file__).resolve().parent.parent / "pyproject.toml"))
