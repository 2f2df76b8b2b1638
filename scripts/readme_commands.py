"""Print one of the README's two opening commands, so CI runs exactly what a new user reads.

The README starts with a bash block of exactly two commands: the first installs and runs the main
job, the second installs and runs the tests. `python scripts/readme_commands.py run|test`.
"""

import re
import sys
from pathlib import Path

KINDS = ("run", "test")


def readme_commands(readme: Path) -> dict[str, str]:
    """The first fenced bash block of `readme`, as {run: line 1, test: line 2}."""
    match = re.search(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    if match is None:
        raise ValueError(f"{readme} has no ```bash block; it must open with the two commands.")
    lines = [ln.strip() for ln in match.group(1).splitlines() if ln.strip()]
    if len(lines) != 2:
        raise ValueError(f"{readme}'s first bash block has {len(lines)} commands, expected 2 "
                         "(install + run, install + test).")
    return dict(zip(KINDS, lines, strict=True))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in KINDS:
        print(f"usage: readme_commands.py {'|'.join(KINDS)}", file=sys.stderr)
        return 2
    print(readme_commands(Path(__file__).resolve().parent.parent / "README.md")[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
