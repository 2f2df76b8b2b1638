"""The README and the docs/ pages against the code: every `dsv41 ...` command they show parses
with the installed command's own parser (its verb and sub-verb always, the whole line where it has
no placeholders), every repository path they name in backticks exists, and every relative link
(and its #anchor) leads somewhere. `test_the_checker_reports_*` shows each check can fail."""

import argparse
import contextlib
import importlib
import io
import re
import shlex
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_PAGES = ("README.md", "architecture.md", "compile-and-targets.md", "runtime-and-tiers.md",
             "serving.md", "benchmarks.md", "numerics-and-ledger.md", "gpu-and-multi-worker.md",
             "testing.md")
README_MAX_LINES = 220
# The repository's top-level entries a backticked path may start with (`artifacts/` is what the
# commands write, not what the repository holds).
TOP = ("graph", "schedules", "compiler", "runtime", "tests", "scripts", "docs", ".ci",
       "pyproject.toml", "README.md")
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A shell operator between two commands: `a && b`, `a | b`, `a & b`, `a; b`.
OPERATOR = re.compile(r"\s(?:&&|\|\||\||&)(?:\s|$)|;\s")


@cache
def _cli():
    """(main, build_parser, normalise) of the installed `dsv41` console script: its entry point
    from the package metadata, `build_parser` and the `dsv41 bench` default from the module that
    defines `main` or the `dsv41.compiler.tools.cli` package (wherever the parser lives now)."""
    try:
        point = entry_points(group="console_scripts")["dsv41"]
        main, modules = point.load(), [importlib.import_module(point.module)]
    except (KeyError, ImportError, AttributeError):  # not installed, or installed before a move
        modules, main = [], None
    modules.append(importlib.import_module("dsv41.compiler.tools.cli"))
    for name in ("main", "parser"):
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(f"dsv41.compiler.tools.cli.{name}"))
    main = main or next(m.main for m in modules if hasattr(m, "main"))
    build_parser = next(m.build_parser for m in modules if hasattr(m, "build_parser"))
    normalise = next((m.with_default_bench_verb for m in modules
                      if hasattr(m, "with_default_bench_verb")), list)
    return main, build_parser, normalise


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _placeholder(token: str) -> bool:
    """`DIR`, `N`, `[--x N]`, `a|b`, `<name>`, `...`, `$VAR`: a word the reader fills in."""
    return bool(re.search(r"[\[\]|<>$]|\.\.\.", token)
                or re.fullmatch(r"[A-Z][A-Z0-9_]*(,[A-Z][A-Z0-9_]*)*", token))


def commands(text: str) -> list[tuple[list[str], bool]]:
    """Every `dsv41 ...` command of a page: (its words after `dsv41`, whether the page shows it
    in a fenced shell block or an inline code span)."""
    found, fenced_spans = [], []
    for match in FENCE.finditer(text):
        fenced_spans.append(match.span())
        if match.group(1) in SHELL_BLOCKS:
            for line in match.group(2).replace("\\\n", " ").splitlines():
                found += [(words, True) for words in _dsv41_segments(line.removeprefix("$ "))]
    prose = text
    for start, end in reversed(fenced_spans):
        prose = prose[:start] + prose[end:]
    for span in INLINE.findall(prose):
        if span.startswith("dsv41 "):
            found += [(words, False) for words in _dsv41_segments(span)]
    return found


def _dsv41_segments(line: str) -> list[list[str]]:
    out = []
    for segment in OPERATOR.split(line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:  # unbalanced quotes: not a command we can read
            words = segment.split()
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words[:1] == ["dsv41"]:
            out.append(words[1:])
    return out


@cache
def _help_works(path: tuple[str, ...]) -> str | None:
    """None when `dsv41 <path> --help` exits 0 in-process, else why not."""
    main = _cli()[0]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*path, "--help"])
        except SystemExit as exit_:
            code = exit_.code
    return None if code in (0, None) else f"exit {code}: {err.getvalue().strip()[-200:]}"


def command_problems(words: list[str], whole: bool = True) -> list[str]:
    """What is wrong with `dsv41 <words>`: an unknown verb or sub-verb, a `--help` that fails, or
    (`whole`, and without placeholders) a line argparse refuses."""
    _, build_parser, normalise = _cli()
    shown = "dsv41 " + " ".join(words)
    plain = 0
    while plain < len(words) and re.fullmatch(r"[a-z][a-z0-9-]*", words[plain]):
        plain += 1
    # `dsv41 <verb>`, `dsv41 bench SUB-VERB`: a placeholder where a verb would be
    generic = (plain < len(words) and _placeholder(words[plain])
               and not re.match(r"\[?-", words[plain]))
    probe = normalise([*words[:plain], *(["--probe"] if plain < len(words) else [])])
    parser, path = build_parser(), []
    for word in probe:
        subs = _subcommands(parser)
        if not subs or word.startswith("-"):
            break
        if word not in subs:
            return [f"`{shown}`: {word!r} is not a verb here (one of {', '.join(sorted(subs))})"]
        path.append(word)
        parser = subs[word]
    if _subcommands(parser) and not generic:
        return [f"`{shown}`: names no sub-verb of {' '.join(path) or 'dsv41'}"]
    problems = []
    if (why := _help_works(tuple(path))) is not None:
        problems.append(f"`dsv41 {' '.join(path)} --help` fails: {why}")
    if whole and not generic and not any(_placeholder(w) for w in words):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                build_parser().parse_args(normalise(list(words)))
            except SystemExit as exit_:
                if exit_.code not in (0, None):
                    problems.append(f"`{shown}` does not parse: {err.getvalue().strip()[-300:]}")
    return problems


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = FENCE.sub("", text)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)}


def path_problems(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """Backticked repository paths that do not exist, and relative links (with their anchors)
    that lead nowhere."""
    problems = []
    for span in INLINE.findall(FENCE.sub("", text)):
        path = span.split("::")[0].rstrip(":,.")
        if not re.fullmatch(r"[\w.\-/]+", path) or path.startswith(("../", "./", "/")):
            continue
        head = path.split("/")[0]
        if (head in TOP and (("/" in path) or path == head)) and not (root / path).exists():
            problems.append(f"`{span}` names a path that does not exist")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if file.startswith("../") and not dest.is_relative_to(root.resolve()):
            continue  # ../shared/...: beside the repository, not in it
        if not dest.exists():
            problems.append(f"link ({target}) leads to no file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            problems.append(f"link ({target}): {dest.name} has no heading #{anchor}")
    return problems


def test_every_page_is_there_and_indexed():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert set(DOC_PAGES) <= names, f"missing docs pages: {set(DOC_PAGES) - names}"
    index, readme = (ROOT / "docs" / "README.md").read_text(), (ROOT / "README.md").read_text()
    for name in DOC_PAGES[1:]:
        assert f"({name}" in index, f"docs/README.md does not link {name}"
        assert f"(docs/{name}" in readme, f"README.md does not link docs/{name}"


def test_the_readme_is_a_five_minute_read():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; the reference belongs in "
                                       "docs/ (one page per subsystem)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_pages_commands_parse_and_its_paths_exist(page):
    text = page.read_text()
    shown = commands(text)
    problems = [p for words, fenced in shown for p in command_problems(words, whole=fenced)]
    problems += path_problems(text, page)
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_pages_show_every_verb():
    """Each verb and `dsv41 bench` sub-verb appears in some page's commands."""
    _, build_parser, _ = _cli()
    shown = {tuple(w[:2]) for p in PAGES for w, _ in commands(p.read_text())}
    verbs = _subcommands(build_parser())
    missing = [v for v in verbs if not any(s[:1] == (v,) for s in shown)]
    missing += [f"bench {s}" for s in _subcommands(verbs["bench"])
                if s != "e2e" and ("bench", s) not in shown]
    assert not missing, f"verbs no page shows: {missing}"


def test_the_checker_reports_a_made_up_verb_path_option_and_link(tmp_path):
    page = tmp_path / "page.md"
    text = ("Run `dsv41 bench no-such-sub --json x.json`, read `graph/no_such_module.py` and\n"
            "`runtime/no_such_room/`, see [there](no-such-page.md) and [here](#no-such-heading).\n"
            "```bash\ndsv41 no-such-verb --preset small\ndsv41 plan --no-such-option 3\n"
            "dsv41 plan --preset FILE && dsv41 bill --preset full | tee bill.txt\n```\n")
    page.write_text(text)
    found = commands(text)
    assert (["plan", "--preset", "FILE"], True) in found
    assert (["bill", "--preset", "full"], True) in found
    problems = [p for words, fenced in found for p in command_problems(words, whole=fenced)]
    problems += path_problems(text, page, ROOT)
    joined = "\n".join(problems)
    assert "'no-such-verb' is not a verb" in joined
    assert "'no-such-sub' is not a verb" in joined
    assert "`dsv41 plan --no-such-option 3` does not parse" in joined
    assert "`graph/no_such_module.py` names a path that does not exist" in joined
    assert "`runtime/no_such_room/` names a path that does not exist" in joined
    assert "(no-such-page.md) leads to no file" in joined
    assert "no heading #no-such-heading" in joined
    assert len(problems) == 7, joined  # the placeholder line and the good ones pass


def test_the_checker_finds_the_parser_the_console_script_runs():
    main, build_parser, _ = _cli()
    assert callable(main) and "run" in _subcommands(build_parser())
    assert "kernels" in _subcommands(_subcommands(build_parser())["bench"])
