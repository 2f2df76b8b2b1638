"""Hostile input to the command line: each case a one-line error with exit code 2 (or argparse's
usage error, also 2) before any model loads, never a traceback, a hang or a file overwritten."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from dsv41.compiler.tools.cli import common
from dsv41.compiler.tools.cli.main import build_parser, main
from dsv41.graph.checkpoint.seeded import WRITTEN_FILES


def _usage_error(argv, capsys, parser: argparse.ArgumentParser | None = None) -> str:
    """argparse's refusal: SystemExit 2 and its stderr (`parser`: parse with it, else `main`)."""
    with pytest.raises(SystemExit) as e:
        main(argv) if parser is None else parser.parse_args(argv)
    assert e.value.code == 2, argv
    return capsys.readouterr().err


def _error(argv, capsys, code: int = 2) -> str:
    """A verb's refusal: `dsv41 <verb>: error: <sentence>` on stderr, the exit code returned."""
    assert main(argv) == code, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---- every numeric option is checked while parsing --------------------------------------------


def _numeric_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(verb path, option, its type) of every option that takes a number, sub-verbs included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_options(sub, (*path, name))
        elif action.option_strings and action.type not in (None, str):
            yield path, action.option_strings[-1], action.type


# the values each type refuses, and one it takes
REFUSED = {
    common.count: ("nan", "-1", "0", "1.5", "x"),
    common.natural: ("nan", "-1", "1.5", "x"),
    common.positive_seconds: ("nan", "inf", "-1", "0", "x"),
    common.seconds: ("nan", "inf", "-inf", "-1", "x"),
    common.probability: ("nan", "-1", "0", "1.5", "x"),
    common.counts: ("0", "1,0", "-1", "nan", "", "x"),
    common.gibibytes: ("nan", "inf", "-1", "0", "x"),
}
TAKEN = {
    common.count: "1",
    common.natural: "0",
    common.positive_seconds: "0.5",
    common.seconds: "0",
    common.probability: "1",
    common.counts: "1,2",
    common.gibibytes: "0.5",
}


def test_every_numeric_option_refuses_nan_negatives_and_zero_counts_while_parsing(capsys):
    parser = build_parser()
    options = list(_numeric_options(parser))
    assert len(options) > 70  # every verb's, not a few
    bare = [(path, flag) for path, flag, t in options if t not in common.NUMERIC_TYPES]
    assert bare == []  # no `type=int` / `type=float`: NaN, -1 and 0 would pass
    for path, flag, t in options:
        for bad in REFUSED[t]:
            err = _usage_error([*path, f"{flag}={bad}"], capsys, parser)
            assert f"argument {flag}: " in err, (path, flag, bad)
        ns = parser.parse_args(
            [*path, f"{flag}={TAKEN[t]}"]
            + (
                ["--out", "o"]
                if path == ("checkpoint",) or path == ("bundle",)
                else ["--checkpoint", "c", "--tokens", "t", "--out", "o"]
                if path == ("score",)
                else []
            )
        )
        assert getattr(ns, action_dest(flag)) == t(TAKEN[t]), (path, flag)


def action_dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def test_the_reported_nonsense_is_refused_with_its_reason(capsys):
    for argv, msg in (
        (["bench", "--budget-s", "nan"], "argument --budget-s: must be a finite number, got 'nan'"),
        (
            ["bench", "--threads", "-1"],
            "argument --threads: must be a whole number of at least 0, got '-1'",
        ),
        (
            ["bench", "serve", "--clients", "0"],
            "argument --clients: must be comma-separated counts of at least 1, got '0'",
        ),
        (
            ["bench", "serve", "--clients", "4,0"],
            "argument --clients: must be comma-separated counts of at least 1, got '4,0'",
        ),
        (
            ["serve", "--log-level", "bogus"],
            "argument --log-level: invalid choice: 'bogus' (choose from 'critical', 'error', "
            "'warning', 'info', 'debug', 'trace')",
        ),
        (["serve", "--role", "prefil"], "argument --role: invalid choice: 'prefil'"),
        (
            ["chat", "--top-p", "0"],
            "argument --top-p: must be a number above 0 and at most 1, got '0'",
        ),
    ):
        assert msg in _usage_error(argv, capsys), argv


# ---- files and folders --------------------------------------------------------------------------


def test_score_refuses_a_folder_or_a_device_as_its_token_file(tmp_path, capsys):
    for tokens in (tmp_path, "/dev/zero"):
        line = _error(
            [
                "score",
                "--checkpoint",
                str(tmp_path / "none"),
                "--tokens",
                str(tokens),
                "--out",
                str(tmp_path / "o.npz"),
            ],
            capsys,
        )
        assert line == (
            f"dsv41 score: error: Token file {tokens} is not a regular file (a "
            "folder, device or pipe); give a .npy file or a text file of ids."
        )


def test_score_refuses_a_token_file_too_large_to_read_whole(tmp_path):
    from dsv41.graph.score import read_tokens

    big = tmp_path / "big.txt"
    big.write_text("1 " * 600)
    assert read_tokens(big, max_bytes=1200).tolist() == [1] * 600
    with pytest.raises(ValueError, match=f"Token file {big} is larger than 1199 bytes"):
        read_tokens(big, max_bytes=1199)
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY not really")
    with pytest.raises(ValueError, match=f"{bad} is not a valid .npy file"):
        read_tokens(bad)


def test_compile_and_tune_refuse_a_file_as_their_out_folder(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("mine")
    for verb in ("compile", "tune"):
        assert _error([verb, "--out", str(f)], capsys) == (
            f"dsv41 {verb}: error: --out {f} cannot be a folder: it is an existing file (or a "
            "broken link), not a folder."
        )
    under = f / "sub"
    assert _error(["compile", "--out", str(under)], capsys) == (
        f"dsv41 compile: error: --out {under} cannot be a folder: {f} is an existing file (or "
        "a broken link), not a folder."
    )
    assert f.read_text() == "mine"


def test_serve_refuses_an_unreachable_redis_before_loading_the_model(capsys, monkeypatch):
    import dsv41.runtime.serving.assembly as assembly

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(assembly, "serving_engine", no_load)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://user:secret@127.0.0.1:{port}/0"
    line = _error(["serve", "--role", "prefill", "--redis-url", url, "--backend", "torch"], capsys)
    assert line.startswith(
        f"dsv41 serve: error: --redis-url redis://user:***@127.0.0.1:{port}/0:"
        " no Redis server answers there ("
    )
    assert "secret" not in line
    line = _error(["serve", "--redis-url", "http://127.0.0.1/0", "--backend", "torch"], capsys)
    assert line.startswith(
        "dsv41 serve: error: --redis-url http://127.0.0.1/0 is not a Redis URL ("
    )


# ---- `dsv41 checkpoint --out`: only into its own folder, replacing only its own files -----------


def _checkpoint(out, capsys, *extra) -> str | int:
    rc = main(["checkpoint", "--preset", "small", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc if rc == 0 else err.strip().splitlines()[-1]


def test_checkpoint_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.json").write_text("theirs")
    (etc / "passwd").write_text("theirs")
    assert _checkpoint(etc, capsys) == (
        f"dsv41 checkpoint: error: Output directory {etc} is not empty (config.json, ...) and "
        "holds no checkpoint written here; choose a new or empty folder."
    )
    assert _checkpoint(etc, capsys, "--overwrite") == (
        f"dsv41 checkpoint: error: Output directory {etc} holds config.json, which no seeded "
        "checkpoint write recorded there; --overwrite replaces only the files an earlier write "
        "recorded. Choose a new or empty folder."
    )
    assert sorted(p.name for p in etc.iterdir()) == ["config.json", "passwd"]
    assert (etc / "config.json").read_text() == (etc / "passwd").read_text() == "theirs"


def test_checkpoint_overwrite_removes_only_the_files_it_wrote(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert _checkpoint(out, capsys) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == [WRITTEN_FILES, "config.json", "model.safetensors"]
    assert json.loads((out / WRITTEN_FILES).read_text()) == {
        "files": ["model.safetensors", "config.json"]
    }
    assert _checkpoint(out, capsys) == (
        f"dsv41 checkpoint: error: Output directory {out} already holds a checkpoint "
        "(config.json, ...); pass overwrite=True (--overwrite) to replace it."
    )
    # a file of someone else's beside it: kept; a safetensors file of theirs: refused, kept
    (out / "NOTES.md").write_text("mine")
    (out / "other.safetensors").write_bytes(b"their weights")
    assert _checkpoint(out, capsys, "--overwrite") == (
        f"dsv41 checkpoint: error: Output directory {out} holds other.safetensors, which no "
        "seeded checkpoint write recorded there; --overwrite replaces only the files an earlier "
        "write recorded. Choose a new or empty folder."
    )
    assert (out / "other.safetensors").read_bytes() == b"their weights"
    (out / "other.safetensors").unlink()
    # a record naming a file it could not have written removes nothing of it
    (out / WRITTEN_FILES).write_text(
        json.dumps({"files": ["model.safetensors", "config.json", "NOTES.md", "../ckpt/NOTES.md"]})
    )
    assert _checkpoint(out, capsys, "--overwrite", "--seed", "1") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["NOTES.md", *written])
    assert (out / "NOTES.md").read_text() == "mine"


def test_serve_limit_flags_reach_the_server_options():
    """`dsv41 serve`'s limit flags (issue 38's limits as options): parsed into HttpLimits on
    ServeOptions; nonsense refused while parsing."""
    from dsv41.compiler.tools.cli.main import build_parser
    from dsv41.runtime.serving.http_limits import HttpLimits

    ns = build_parser().parse_args(["serve", "--max-body-mib", "4", "--max-json-depth", "9",
                                    "--header-timeout", "2.5", "--body-timeout", "7",
                                    "--max-connections", "20"])
    assert ns.options(ns).limits == HttpLimits(max_body_bytes=4 << 20, max_json_depth=9,
                                               header_timeout_s=2.5, body_timeout_s=7.0,
                                               max_connections=20)
    assert build_parser().parse_args(["serve"]).options(
        build_parser().parse_args(["serve"])).limits == HttpLimits()
    for bad in (["--max-body-mib", "0"], ["--header-timeout", "nan"],
                ["--body-timeout", "0"], ["--max-connections", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
