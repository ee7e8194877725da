"""CLI conventions across every subcommand of ``kvarn_cutlass.cli.COMMANDS`` (a new command is covered
by being listed there): ``--help`` exits 0 with its usage; an unknown flag, a bad number or a missing
input path exits non-zero with exactly one line on stderr naming the problem; ``--json`` output
parses. Run in-process through ``kvarn_cutlass.cli.main`` (fast), plus the installed entry point and
``python -m kvarn_cutlass.cli`` in subprocesses."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvarn_cutlass import cli
from kvarn_cutlass.cli import argtypes, main

from _helpers import SHARED

COMMANDS = sorted(cli.COMMANDS)
MODEL = SHARED / "models" / "kvarn-ref-lm"
REPO = Path(__file__).resolve().parents[1]


def subparser(name: str) -> argparse.ArgumentParser:
    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def options(name: str) -> list[argparse.Action]:
    return [a for a in subparser(name)._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def required_args(name: str, tmp_path: Path, skip: argparse.Action | None = None) -> list[str]:
    """Valid values for the command's required options (and one member of each required mutually
    exclusive group), so that a test can isolate one bad argument."""
    p = subparser(name)
    picks = [a for a in p._actions if a.required and a.option_strings]
    for group in p._mutually_exclusive_groups:
        if group.required and not any(a in picks for a in group._group_actions):
            picks.append(group._group_actions[0])
    argv = []
    for a in picks:
        if a is skip:
            continue
        if a.type is argtypes.existing_dir:
            value = str(tmp_path)
        elif a.type is argtypes.existing_file:
            value = str(tmp_path / "input.txt")
            Path(value).write_text("hello\n")
        elif a.choices:
            value = str(next(iter(a.choices)))
        else:
            value = "1"
        argv += [a.option_strings[-1], value]
    return argv


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


# --- --help -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", COMMANDS)
def test_help_exits_zero_with_usage(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvarn-cutlass {name}")
    for action in options(name):  # every option is documented
        assert action.option_strings[-1] in out
        assert action.help, f"{name} {action.option_strings[-1]} has no help text"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_describes_the_command_and_states_every_default(name):
    p = subparser(name)
    assert p.description and len(p.description) > 40, f"{name} --help has no description"
    for action in options(name):
        default = action.default
        if default in (None, False, argparse.SUPPRESS):
            continue
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert "default" in action.help and shown in action.help, (name, action.option_strings[-1], action.help)


HEAVY_MODULES = ("torch", "numpy", "transformers", "cuda", "cutlass", "cutlass_library")

_HELP_IMPORTS = """
import contextlib, io, json, sys
from kvarn_cutlass import cli
loaded = {}
for argv in [["--help"]] + [[name, "--help"] for name in sorted(cli.COMMANDS)]:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    loaded[" ".join(argv)] = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
print(json.dumps(loaded))
"""


def test_help_imports_no_heavy_module():
    """--help of the tool and of every command answers without importing torch (seconds to import),
    numpy, transformers or the CUDA/CUTLASS bindings: a fresh interpreter, its modules checked."""
    proc = subprocess.run([sys.executable, "-c", _HELP_IMPORTS, *HEAVY_MODULES], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert set(loaded) == {"--help"} | {f"{name} --help" for name in COMMANDS}
    assert all(mods == [] for mods in loaded.values()), loaded


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_command_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in one_error_line(capsys)


# --- bad arguments ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", COMMANDS)
def test_unknown_flag_is_a_one_line_error(name, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([name, *required_args(name, tmp_path), "--no-such-flag"])
    assert exc.value.code == 2
    assert "--no-such-flag" in one_error_line(capsys)


def _numeric_options():
    """(command, option) for every option whose type converts numbers (int/float-like)."""
    out = []
    for name in COMMANDS:
        for a in options(name):
            if a.type in (None, argtypes.regex, argtypes.non_empty) or a.nargs == 0:  # text types accept "7" too
                continue
            try:
                a.type("7")
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                continue  # not numeric (paths, JSON, formats)
            out.append((name, a.option_strings[-1]))
    return out


@pytest.mark.parametrize("name,option", _numeric_options())
def test_negative_and_non_numbers_are_rejected_at_parse_time(name, option, capsys, tmp_path):
    """Counts, sizes and budgets are never negative: ``--tokens -5`` fails before any work."""
    for bad in ("-5", "abc"):
        with pytest.raises(SystemExit) as exc:
            main([name, *required_args(name, tmp_path), option, bad])
        assert exc.value.code == 2, (option, bad)
        line = one_error_line(capsys)
        assert option in line and bad in line, line


def _path_options():
    return [(name, a.option_strings[-1], a.type) for name in COMMANDS for a in options(name)
            if a.type in (argtypes.existing_file, argtypes.existing_dir)]


def test_inputs_of_the_model_commands_are_checked_paths():
    found = {(n, o) for n, o, _ in _path_options()}
    for needed in (("demo", "--model"), ("demo", "--text"), ("perplexity", "--model"), ("perplexity", "--text"),
                   ("generate", "--model"), ("generate", "--prompts-from")):
        assert needed in found, needed


@pytest.mark.parametrize("name,option,kind", _path_options())
def test_missing_input_path_is_a_one_line_error(name, option, kind, capsys, tmp_path):
    missing = str(tmp_path / "does-not-exist")
    action = next(a for a in options(name) if a.option_strings[-1] == option)
    with pytest.raises(SystemExit) as exc:
        main([name, *required_args(name, tmp_path, skip=action), option, missing])
    assert exc.value.code == 2
    line = one_error_line(capsys)
    assert option in line and "does-not-exist" in line


@pytest.mark.parametrize("argv,fragment", [
    (["sass", "--bucket", "M20"], "--bucket"),
    (["sass", "--config", "[1, 2]"], "--config"),
    (["tune", "--buckets", "D128"], "--buckets"),
    (["demo", "--preset", "k3v1"], "--preset"),
    (["perplexity", "--preset", "k3v1"], "--preset"),
])
def test_bad_formats_are_one_line_usage_errors(argv, fragment, capsys, tmp_path):
    name = argv[0]
    with pytest.raises(SystemExit) as exc:
        main([name, *required_args(name, tmp_path), *argv[1:]])
    assert exc.value.code == 2
    assert fragment in one_error_line(capsys)


def test_runtime_errors_are_one_line_with_exit_status_1(capsys):
    assert main(["build", "--arch", "sm12", "--family", "selftest"]) == 1
    line = one_error_line(capsys)
    assert line.startswith("kvarn-cutlass build: error:") and "sm12" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["demo", "perplexity", "generate"])
def test_device_cuda_without_cuda_is_one_line(name, capsys, tmp_path):
    argv = [name, "--device", "cuda"]
    if name != "demo":
        if not (MODEL / "config.json").is_file():
            pytest.skip("shared reference model not present")
        argv += ["--model", str(MODEL)] + (["--text", __file__] if name == "perplexity" else ["--prompt", "x"])
    assert main(argv) == 1
    assert "cuda" in one_error_line(capsys).lower()


# --- --json ---------------------------------------------------------------------------------------------
def _json_invocation(name: str, tmp_path: Path) -> list[str]:
    """A cheap run of ``name`` with --json; skips where it needs what this machine lacks."""
    if name == "demo":
        return ["demo", "--device", "cpu", "--no-compile", "--tokens", "300", "--chunk", "128", "--window", "128"]
    if name == "build":
        return ["build", "--arch", "sm80", "--family", "selftest"]
    if name == "info":
        return ["info"]
    if name in ("perplexity", "generate"):
        if not (MODEL / "config.json").is_file():
            pytest.skip("shared reference model not present")
        pytest.importorskip("transformers")
        if name == "generate":
            return ["generate", "--model", str(MODEL), "--prompt", "def add(a, b):", "--max-new-tokens", "3",
                    "--device", "cpu", "--window", "128"]
        text = tmp_path / "eval.txt"
        text.write_text((SHARED / "data" / "code_eval.txt").read_text(encoding="utf-8")[:4000])
        return ["perplexity", "--model", str(MODEL), "--text", str(text), "--ctx", "256", "--windows", "1",
                "--window", "128", "--batch", "1", "--device", "cpu", "--no-progress"]
    if name == "bench":
        pytest.skip("bench --json runs GPU sections; the bench tests check its JSON")
    raise AssertionError(f"{name} has --json: add a cheap invocation of it to _json_invocation")


@pytest.mark.parametrize("name", [n for n in COMMANDS if any("--json" in a.option_strings for a in options(n))])
def test_json_output_parses(name, capsys, tmp_path):
    argv = _json_invocation(name, tmp_path)
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict) and doc


def test_generate_takes_the_quantizer(capsys, tmp_path):
    argv = _json_invocation("generate", tmp_path)
    assert main([*argv, "--quantizer", "lloyd_max", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["quantizer"] == "lloyd_max" and doc["preset"] == "k4v2_g128"


def test_commands_a_script_parses_offer_json():
    for name in ("demo", "perplexity", "generate", "build"):
        assert any("--json" in a.option_strings for a in options(name)), name


# --- the installed entry point and python -m ------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ)  # this checkout first, whatever an editable install points at
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.mark.parametrize("launcher", ["entry point", "python -m"])
def test_subprocess_help_and_bad_argument(launcher):
    if launcher == "entry point":
        exe = shutil.which("kvarn-cutlass")
        if exe is None:
            pytest.skip("kvarn-cutlass is not on PATH (package not installed)")
        base = [exe]
    else:
        base = [sys.executable, "-m", "kvarn_cutlass.cli"]
    ok = subprocess.run([*base, "demo", "--help"], capture_output=True, text=True, env=_env(), timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: kvarn-cutlass demo"), ok.stderr
    bad = subprocess.run([*base, "demo", "--tokens", "-5"], capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokens" in lines[0] and "-5" in lines[0], bad.stderr


# --- errors before the model loads ---------------------------------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the errors below must come before it (a model dir is any dir)."""
    pytest.importorskip("transformers")
    from kvarn_cutlass.hf import _compat

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the argument error")

    monkeypatch.setattr(_compat, "load_model", load_model)


def _binary_file(tmp_path: Path) -> Path:
    path = tmp_path / "weights.bin"
    # 0xd0 0x9f is UTF-8 (a Cyrillic letter); 0xff, at offset 13, never is
    path.write_bytes(b"PK\x03\x04\x14\x00\x08\x08\x00\x00\xd0\x9fX\xff\xfe")
    return path


@pytest.mark.parametrize("argv,status,fragments", [
    (["generate", "--prompt", ""], 2, ["--prompt", "must not be empty"]),
    (["generate", "--prompt", "x", "--window", "100"], 1, ["window", "multiple of the tile size 128"]),
    (["generate", "--prompts-from", "BINARY"], 1, ["--prompts-from", "weights.bin", "not UTF-8", "offset 13"]),
    (["perplexity", "--text", "BINARY"], 1, ["--text", "weights.bin", "not UTF-8", "offset 13"]),
    (["perplexity", "--text", "TEXT", "--method", "decode", "--window", "0"], 1, ["--window 0", "--method sim"]),
    (["perplexity", "--text", "TEXT", "--method", "prefill", "--window", "0"], 1, ["--window 0", "--method prefill"]),
    (["demo", "--no-compile", "--text", "BINARY"], 1, ["--text", "weights.bin", "not UTF-8", "offset 13"]),
])
def test_bad_inputs_fail_before_the_model_loads(argv, status, fragments, capsys, tmp_path, no_model_load):
    text = tmp_path / "eval.txt"
    text.write_text("def f():\n    return 1\n" * 20)
    values = {"BINARY": str(_binary_file(tmp_path)), "TEXT": str(text)}
    argv = [values.get(a, a) for a in argv]
    name = argv[0]
    try:
        rc = main([name, "--model", str(tmp_path), "--device", "cpu", *argv[1:]])
    except SystemExit as exc:
        rc = exc.code
    assert rc == status
    line = one_error_line(capsys)
    for fragment in fragments:
        assert fragment in line, line


def test_generate_reports_progress_and_says_when_no_tile_was_used(capsys, tmp_path):
    argv = _json_invocation("generate", tmp_path)  # a 5-token prompt + 3 tokens inside a 128-token window
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "generate [6/6] prompt 1/1 done" in err  # 2 passes x 3 tokens, one line per prompt off a terminal
    assert "100.0%" in err and "no prompt reached a quantized tile" in err
    text = tmp_path / "eval.txt"
    text.write_text((SHARED / "data" / "code_eval.txt").read_text(encoding="utf-8")[:20000])
    assert main(["generate", "--model", str(MODEL), "--prompts-from", str(text), "--num-prompts", "2",
                 "--prompt-tokens", "130", "--max-new-tokens", "2", "--window", "128", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["prompts_without_tiles"] == 0 and all(r["tokens_in_tiles"] == 128 for r in doc["per_prompt"])
    assert "prompt 1/2 done" in captured.err and "prompt 2/2 done" in captured.err
