"""Every user-facing input, given wrong, is a clear error: status 2, no traceback, nothing lost.

Case files (each field dropped, mistyped, out of range; truncated), report files given to
merge/gate/plot (truncated, keys dropped or mistyped), CLI options, backend option strings,
``--plugin`` paths and the environment (GPU masks, ``HYPOTHESIS_PROFILE``). Each refusal names
the field or option and the value, exits with status 2 (pytest: its usage error), writes
nothing, and leaves an earlier report, the artifacts and the corpus as they were.

Malformed case and report files are drawn by Hypothesis; the examples are cheap in-process
CLI calls, so the ``ci`` profile's 25 examples take a second or two.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from difftest import cli
from difftest.case.spec import Case
from difftest.contract import registry
from difftest.machine import gpus

TINY = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),), seed=4)
CASE_FIELDS = {f.name: f for f in dataclasses.fields(Case)}
REQUIRED = sorted(n for n, f in CASE_FIELDS.items() if f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING)
HINTS = typing.get_type_hints(Case)
# Hypothesis examples share one temporary directory per test, not a fixture per example.
EXAMPLES = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


def call(argv: list[str]) -> tuple[int, str]:
    """``difftest ARGV`` in this process: its exit status and its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse refuses the command line
            code = int(exc.code or 0)
    return code, err.getvalue()


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (directories included as empty entries)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


@contextlib.contextmanager
def untouched(root: Path) -> Iterator[None]:
    """Assert that nothing under ``root`` is created, changed or removed."""
    before = snapshot(root)
    yield
    assert snapshot(root) == before


def refused(argv: list[str], root: Path, *texts: str) -> str:
    """Run ``argv``; assert exit 2, no traceback, each of ``texts`` in stderr, ``root`` intact."""
    with untouched(root):
        code, err = call(argv)
    assert code == 2, (argv, err)
    assert "Traceback" not in err, err
    for text in texts:
        assert text in err, (text, err)
    return err


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A directory holding earlier results: a report, a failure artifact, a pinned corpus."""
    (tmp_path / "earlier.json").write_text('{"an earlier report": "must survive"}\n')
    failure = tmp_path / "art" / "failures" / TINY.case_id
    failure.mkdir(parents=True)
    (failure / "case.json").write_text(TINY.to_json())
    (failure / "results.json").write_text(json.dumps({"case_id": TINY.case_id, "results": []}))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "tiny.json").write_text(TINY.replace(name="tiny").to_json() + "\n")
    (tmp_path / "case.json").write_text(TINY.to_json())
    return tmp_path


@pytest.fixture(scope="module")
def report_text(tmp_path_factory: pytest.TempPathFactory, device_name: str) -> str:
    """The text of a real one-case report (a replay of TINY on the reference)."""
    directory = tmp_path_factory.mktemp("report")
    (directory / "case.json").write_text(TINY.to_json())
    code, err = call(["repro", str(directory / "case.json"), "--backends", "torch-ref",
                      "--device", device_name, "--artifacts", str(directory / "art"),
                      "--report", str(directory / "r.json")])
    assert code == 0, err
    return (directory / "r.json").read_text()


# ----- case files ------------------------------------------------------------------------

def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(
        max_size=5)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=6)


def _is_json_type(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the JSON type a field of type ``hint`` takes."""
    if hint is bool or isinstance(value, bool):
        return hint is bool and isinstance(value, bool)
    if hint in (int, float, str):
        return isinstance(value, {int: int, float: (int, float), str: str}[hint])
    item = typing.get_args(hint)[0]
    return isinstance(value, list) and all(_is_json_type(item, v) for v in value)


def _promote(case_file: Path, corpus: Path) -> tuple[int, str]:
    return call(["promote", str(case_file), "pinned", "--corpus", str(corpus)])


@EXAMPLES
@given(field=st.sampled_from(sorted(CASE_FIELDS)), value=_json_values())
def test_a_mistyped_case_field_is_named_with_its_value(workspace: Path, field: str,
                                                       value: Any) -> None:
    data = {k: v for k, v in TINY.to_dict().items() if k != "id"}
    data[field] = value
    if _is_json_type(HINTS[field], value):
        return  # a well-typed value: its range is judged by the next test
    case_file = workspace / "mutated.json"
    case_file.write_text(json.dumps(data))
    refused(["promote", str(case_file), "pinned", "--corpus", str(workspace / "corpus")],
            workspace, f"difftest promote: error: {case_file}: {field}: = ",
            json.dumps(value)[:40])


@EXAMPLES
@given(field=st.sampled_from(sorted(n for n in CASE_FIELDS if HINTS[n] is int)),
       value=st.integers(-(2**70), 2**70))
def test_an_integer_field_out_of_range_is_refused_naming_a_field(workspace: Path, field: str,
                                                                  value: int) -> None:
    """Either the mutated case is valid (and pinned) or the error names the field at fault
    (the mutated one, or one it made inconsistent, such as a block id past a smaller cache)."""
    data = {k: v for k, v in TINY.to_dict().items() if k != "id"}
    data[field] = value
    case_file = workspace / "mutated.json"
    case_file.write_text(json.dumps(data))
    with tempfile.TemporaryDirectory() as corpus:
        code, err = _promote(case_file, Path(corpus))
        if code == 0:
            assert Case.from_json((Path(corpus) / "pinned.json").read_text()).case_id
            return
    assert code == 2 and "Traceback" not in err, err
    named = err.split(f"difftest promote: error: {case_file}: ", 1)[1].split(":")[0]
    assert named.split("[")[0] in CASE_FIELDS, err
    assert "(allowed: " in err, err


@pytest.mark.parametrize("field", REQUIRED)
def test_a_missing_required_field_is_named(workspace: Path, field: str) -> None:
    data = TINY.to_dict()
    del data[field], data["id"]
    case_file = workspace / "mutated.json"
    case_file.write_text(json.dumps(data))
    refused(["promote", str(case_file), "pinned", "--corpus", str(workspace / "corpus")],
            workspace, f"{case_file}: {field}: is missing (allowed: a required field)")


@EXAMPLES
@given(cut=st.integers(0, len(TINY.to_json()) - 1))
def test_a_truncated_case_file_names_the_file_for_promote_and_repro(workspace: Path,
                                                                    cut: int) -> None:
    case_file = workspace / "truncated.json"
    case_file.write_text(TINY.to_json()[:cut])
    refused(["promote", str(case_file), "pinned", "--corpus", str(workspace / "corpus")],
            workspace, f"{case_file}: not JSON (truncated or corrupt?)")
    refused(["repro", str(case_file), "--artifacts", str(workspace / "art")], workspace,
            f"difftest repro: error: {case_file}: not JSON")


def test_other_case_file_errors(workspace: Path) -> None:
    directory = workspace / "art" / "failures" / TINY.case_id
    refused(["repro", str(workspace / "nothing.json")], workspace,
            f"cannot read {workspace / 'nothing.json'}: No such file or directory")
    (workspace / "list.json").write_text("[1, 2]")
    refused(["repro", str(workspace / "list.json")], workspace,
            "list.json: case: is a JSON list (allowed: a JSON object of fields)")
    (workspace / "unknown.json").write_text(json.dumps(TINY.to_dict() | {"blocks": 3}))
    refused(["promote", str(workspace / "unknown.json"), "x", "--corpus",
             str(workspace / "corpus")], workspace, "blocks: is not a case field")
    (workspace / "wrong-id.json").write_text(json.dumps(TINY.to_dict() | {"seed": 5}))
    refused(["promote", str(workspace / "wrong-id.json"), "x", "--corpus",
             str(workspace / "corpus")], workspace,
            f"id: {TINY.case_id} does not match the content")
    (directory / "case.json").write_text("{")
    with untouched(workspace):  # a damaged failure directory is itself an earlier result
        code, err = call(["repro", str(directory), "--artifacts", str(workspace / "replays")])
    assert code == 2 and f"{directory / 'case.json'}: not JSON" in err, err
    refused(["promote", str(workspace / "case.json"), "bad name", "--corpus",
             str(workspace / "corpus")], workspace,
            "corpus name 'bad name': allowed letters, digits, '-', '_' and '.'")
    refused(["promote", str(workspace / "case.json").replace("case", "nothing"), "x"],
            workspace, "cannot read")


# ----- report files ----------------------------------------------------------------------

def _report_commands(path: Path, good: Path, output: Path) -> list[list[str]]:
    return [["merge", str(good), str(path), "-o", str(output)],
            ["gate", str(good), str(path)], ["gate", str(path), str(good)],
            ["plot", str(path), "-o", str(output.with_suffix(".png"))]]


@EXAMPLES
@given(data=st.data())
def test_a_truncated_or_damaged_report_names_the_file(workspace: Path, report_text: str,
                                                      data: st.DataObject) -> None:
    good = workspace / "good.json"
    good.write_text(report_text)
    report = json.loads(report_text)
    how = data.draw(st.sampled_from(["truncate", "drop", "mistype"]))
    if how == "truncate":
        text = report_text[:data.draw(st.integers(0, len(report_text.rstrip()) - 1))]
        expected = "not JSON"
    else:
        key = data.draw(st.sampled_from(["schema", "cases", "backends", "fingerprint",
                                         "config"]))
        if how == "drop":
            del report[key]
        else:
            report[key] = data.draw(st.sampled_from([None, 3, "text", True]) if key != "schema"
                                    else st.sampled_from(["difftest.report/0", None, 3]))
        text, expected = json.dumps(report), key
    bad = workspace / "bad.json"
    bad.write_text(text)
    for argv in _report_commands(bad, good, workspace / "earlier.json"):
        err = refused(argv, workspace, f"difftest {argv[0]}: ")
        assert f"{bad}: " in err and expected in err, err


def test_a_report_that_is_no_report(workspace: Path, report_text: str) -> None:
    good = workspace / "good.json"
    good.write_text(report_text)
    for name, text, expected in [("missing.json", None, "cannot read"),
                                 ("empty.json", "", "not JSON"),
                                 ("list.json", "[]", "list.json: "),
                                 ("case.json", TINY.to_json(), "case.json: ")]:
        path = workspace / name
        if text is not None:
            path.write_text(text)
        for argv in _report_commands(path, good, workspace / "earlier.json"):
            refused(argv, workspace, f"{path}", expected)


# ----- hostile files: deep, endless, blocking, oversized -----------------------------------

def _all_readers(path: Path, good: Path, workspace: Path) -> list[list[str]]:
    """Every command that reads a user's JSON file, pointed at ``path``."""
    return [["repro", str(path), "--artifacts", str(workspace / "art")],
            ["promote", str(path), "x", "--corpus", str(workspace / "corpus")],
            *_report_commands(path, good, workspace / "earlier.json")]


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM after ``seconds``."""
    def expire(*_: object) -> None:
        raise TimeoutError(f"still reading after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("shape", ["[", '{"a":'])
def test_deeply_nested_json_is_refused_by_every_reader(workspace: Path, report_text: str,
                                                       shape: str) -> None:
    """100,000 levels reached Python's recursion limit (``RecursionError``, exit 1, which
    ``gate`` means as "failed")."""
    good = workspace / "good.json"
    good.write_text(report_text)
    deep = workspace / "deep.json"
    deep.write_text((shape + " " * 16) * 100_000)  # spaced, or its parse cost refuses it first
    for argv in _all_readers(deep, good, workspace):
        refused(argv, workspace, f"{deep}: nested 100000 deep (allowed: at most 64 levels")


def test_devices_and_fifos_are_refused_without_reading(workspace: Path, report_text: str,
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    """``/dev/zero`` was read without bound (8 GB in 13 s) and a FIFO hung every reader."""
    good = workspace / "good.json"
    good.write_text(report_text)
    fifo = tmp_path_factory.mktemp("fifo") / "pipe.json"  # outside what refused() snapshots
    os.mkfifo(fifo)
    with within(60):
        for path, kind in ((Path("/dev/zero"), "a device"), (fifo, "a FIFO")):
            for argv in _all_readers(path, good, workspace):
                refused(argv, workspace, f"{path}: is {kind} (allowed: a regular file)")


def test_an_oversized_file_is_refused(workspace: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    from difftest.primitives import jsonfile

    good = workspace / "good.json"
    big = workspace / "big.json"
    big.write_text(" " * 2000 + "{}")
    monkeypatch.setattr(jsonfile, "MAX_BYTES", 1000)
    for argv in [*_all_readers(big, good, workspace)[:2], ["gate", str(big), str(big)]]:
        refused(argv, workspace, f"{big}: larger than 1000 bytes (allowed: at most 1000)")


def test_a_failure_directory_of_two_cases_is_refused(workspace: Path) -> None:
    """case.json of one case beside results.json of another was replayed and promoted."""
    directory = workspace / "art" / "failures" / TINY.case_id
    from difftest.results.features import case_features
    from difftest.results.records import CaseRecord

    other = TINY.replace(seed=99)
    (directory / "results.json").write_text(json.dumps(CaseRecord(
        case_id=other.case_id, name="", case=other.to_dict(), features=case_features(other),
        reference="torch-ref", results=[]).to_dict()))
    message = (f"{directory}: case.json holds case {TINY.case_id} but results.json records "
               f"case {other.case_id}")
    refused(["repro", str(directory), "--artifacts", str(workspace / "replays")], workspace,
            message)
    refused(["promote", str(directory), "x", "--corpus", str(workspace / "corpus")], workspace,
            message)


# ----- CLI options -----------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "texts"), [
    (["run", "--examples", "-1"], ["argument --examples: '-1' is negative"]),
    (["run", "--examples", "many"], ["argument --examples: 'many' is not an integer"]),
    (["run", "--seed", "x"], ["argument --seed: invalid int value: 'x'"]),
    (["run", "--device", "tpu"], ["argument --device: invalid choice: 'tpu'"]),
    (["run", "--shard", "0/4"], ["--shard 0/4: K must be 1..N"]),
    (["run", "--shard", "a/b"], ["--shard 'a/b': expected K/N"]),
    (["run", "--backends", ","], ["argument --backends: ',' names no backend"]),
    (["run", "--backends", "torch-ref,rounded,rounded"], ["names 'rounded' twice"]),
    (["run", "--report", "{ws}"], ["argument --report: '{ws}' is a directory"]),
    (["run", "--artifacts", "{ws}/earlier.json"], ["'{ws}/earlier.json' is a file"]),
    (["run", "--report", "{ws}/earlier.json/r.json"], ["earlier.json is a file"]),
    (["gate", "{ws}/a.json", "{ws}/b.json", "--max-ratio-growth", "0.5"],
     ["argument --max-ratio-growth: '0.5' is not allowed (allowed: a finite number >= 1)"]),
    (["gate", "{ws}/a.json", "{ws}/b.json", "--max-ratio-growth", "nan"], ["'nan'"]),
    (["gate", "{ws}/a.json", "{ws}/b.json", "--ratio-floor", "-1"],
     ["argument --ratio-floor: '-1' is not allowed (allowed: a finite number >= 0)"]),
    (["gate", "{ws}/a.json"], ["the following arguments are required: candidate"]),
    (["merge", "{ws}/a.json", "-o", "{ws}/art"], ["argument -o/--output: '{ws}/art' is a "
                                                 "directory"]),
    (["promote", "{ws}/case.json", "x", "--corpus", "{ws}/earlier.json"],
     ["argument --corpus: '{ws}/earlier.json' is a file"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
])
def test_bad_options_name_the_option_and_value(workspace: Path, argv: list[str],
                                               texts: list[str]) -> None:
    ws = str(workspace)
    refused([a.replace("{ws}", ws) for a in argv], workspace,
            *(t.replace("{ws}", ws) for t in texts))


# ----- backend names and plug-ins ----------------------------------------------------------

@pytest.mark.parametrize(("backends", "text"), [
    ("no-such-kernel", "unknown backend 'no-such-kernel'; known backends: "),
    ("aiter-gluon@emulated[k_trim=sideways]",
     "k_trim='sideways' is not one of on, off, before-stride"),
    ("aiter-gluon@emulated[trim=off]", "unknown option 'trim' (options: "),
    ("aiter-gluon@emulated[k_trim]", "option 'k_trim' is not key=value"),
    ("aiter-gluon@emulated[k_trim=off", "argument --backends: backend list "
                                        "'aiter-gluon@emulated[k_trim=off': unbalanced"),
    ("a],b", "backend list 'a],b': unbalanced '[' and ']'"),
    ("torch-ref[a=b]", "backend 'torch-ref' takes no options (got 'torch-ref[a=b]')"),
    # the last value won silently
    ("aiter-gluon@emulated[k_trim=off,k_trim=on]",
     "backend 'aiter-gluon@emulated[k_trim=off,k_trim=on]': option 'k_trim' is given twice"),
    # two spellings of one backend ran twice under one name
    ("aiter-gluon@emulated[k_trim=on],aiter-gluon@emulated",
     "backends 'aiter-gluon@emulated[k_trim=on]' and 'aiter-gluon@emulated' are one backend, "
     "'aiter-gluon@emulated'"),
])
def test_bad_backend_names_and_options(workspace: Path, backends: str, text: str,
                                       device_name: str) -> None:
    refused(["run", "--no-corpus", "--examples", "1", "--device", device_name, "--backends",
             backends, "--artifacts", str(workspace / "art"), "--report",
             str(workspace / "earlier.json")], workspace, "difftest run: error: ", text)


def test_a_reference_that_cannot_serve_is_refused(workspace: Path, device_name: str) -> None:
    refused(["run", "--no-corpus", "--examples", "1", "--device", device_name, "--reference",
             "triton-unified", "--artifacts", str(workspace / "art")], workspace,
            "'triton-unified' cannot serve as the reference")


NAME_CHARS = st.sampled_from([*"abt-@[]=,!_ ", "torch-ref", "aiter-gluon@emulated", "k_trim",
                              "off", "revision"])


@EXAMPLES
@given(text=st.lists(NAME_CHARS, max_size=12).map("".join))
def test_any_backend_string_is_a_list_of_backends_or_a_clear_error(text: str) -> None:
    """No backend string reaches a traceback: it selects backends or is refused by name."""
    known = registry.discover()
    try:
        names = cli._backend_names(text)
    except argparse.ArgumentTypeError as exc:
        assert repr(text) in str(exc)
        return
    try:
        chosen = registry.select(known, names)
    except registry.RegistryError as exc:
        assert "backend" in str(exc) and "'" in str(exc)
        return
    assert len(chosen) == len(names)


@pytest.mark.parametrize(("plugin", "texts"), [
    ("{ws}/missing.py", ["--plugin {ws}/missing.py: no file {ws}/missing.py"]),
    ("{ws}/raises.py", ["--plugin {ws}/raises.py: importing {ws}/raises.py failed: "
                        "ZeroDivisionError: division by zero"]),
    ("{ws}/fine.py:NOPE", ["--plugin {ws}/fine.py:NOPE: {ws}/fine.py has no attribute 'NOPE'"]),
    ("{ws}/fine.py:NOT_A_BACKEND", ["--plugin {ws}/fine.py:NOT_A_BACKEND: 42 is not a "
                                    "difftest Backend"]),
    ("{ws}/fine.py", ["module defines no DIFFTEST_BACKENDS"]),
    ("{ws}/fine.py:make", ["calling 'make' raised RuntimeError: no GPU table"]),
    ("no_such_plugin_module:Thing", ["--plugin no_such_plugin_module:Thing: "
                                     "ModuleNotFoundError: No module named "
                                     "'no_such_plugin_module'"]),
])
@pytest.mark.parametrize("command", ["backends", "run"])
def test_bad_plugins_name_the_plugin(workspace: Path, plugin: str, texts: list[str],
                                     command: str, device_name: str) -> None:
    (workspace / "raises.py").write_text("1 / 0\n")
    (workspace / "fine.py").write_text(
        "NOT_A_BACKEND = 42\n\ndef make():\n    raise RuntimeError('no GPU table')\n")
    ws = str(workspace)
    extra = (["--no-corpus", "--examples", "1", "--artifacts", f"{ws}/art", "--report",
              f"{ws}/earlier.json"] if command == "run" else [])
    refused([command, "--device", device_name, "--plugin", plugin.replace("{ws}", ws), *extra],
            workspace, f"difftest {command}: error: ", *(t.replace("{ws}", ws) for t in texts))


# ----- the environment -------------------------------------------------------------------

@pytest.fixture
def two_fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Driver files of two NVIDIA and two AMD GPUs, as :mod:`difftest.machine.gpus` reads them."""
    nvidia, kfd = tmp_path / "nvidia-gpus", tmp_path / "kfd-nodes"
    for i in range(2):
        (nvidia / f"0000:0{i}:00.0").mkdir(parents=True)
        (kfd / str(i + 1)).mkdir(parents=True)
        (kfd / str(i + 1) / "gpu_id").write_text(f"{1000 + i}\n")
    monkeypatch.setattr(gpus, "NVIDIA_GPUS_DIR", nvidia)
    monkeypatch.setattr(gpus, "KFD_NODES_DIR", kfd)


@pytest.mark.parametrize(("variable", "value", "entry"), [
    ("CUDA_VISIBLE_DEVICES", "garbage", "garbage"),
    ("CUDA_VISIBLE_DEVICES", "0,gpu1", "gpu1"),
])
@pytest.mark.parametrize("command", ["backends", "run"])
def test_a_garbage_gpu_mask_names_the_variable(workspace: Path, two_fake_gpus: None,
                                               monkeypatch: pytest.MonkeyPatch, variable: str,
                                               value: str, entry: str, command: str) -> None:
    for var in gpus.VISIBILITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(variable, value)
    extra = ["--no-corpus", "--examples", "1", "--artifacts", str(workspace / "art"),
             "--report", str(workspace / "earlier.json")] if command == "run" else []
    refused([command, "--device", "auto", *extra], workspace,
            f"difftest {command}: error: {variable}={value!r}: entry {entry!r} is neither a "
            "GPU index nor a UUID")


def _pytest(directory: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    (directory / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("PYTEST_") and k not in gpus.VISIBILITY_VARS}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-o", "difftest=true"], cwd=directory, env=base | env,
                          capture_output=True, text=True, timeout=120)


def test_pytest_refuses_an_unknown_hypothesis_profile(tmp_path: Path) -> None:
    done = _pytest(tmp_path, {"HYPOTHESIS_PROFILE": "fast"})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert ("difftest: HYPOTHESIS_PROFILE='fast' is not a difftest profile (allowed: ci, dev, "
            "nightly)") in done.stderr
    assert "Traceback" not in done.stderr


def test_pytest_refuses_a_garbage_gpu_mask(tmp_path: Path) -> None:
    done = _pytest(tmp_path, {"DIFFTEST_FAKE_GPUS": "amd:2", "HIP_VISIBLE_DEVICES": "0,x",
                              "HYPOTHESIS_PROFILE": "ci"})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert ("difftest GPU pinning: HIP_VISIBLE_DEVICES='0,x': entry 'x' is neither a GPU index "
            "nor a UUID") in done.stderr


@pytest.mark.parametrize("command", ["backends", "run", "repro"])
def test_device_cuda_without_a_visible_gpu_is_refused(workspace: Path, command: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for var in gpus.VISIBILITY_VARS:  # every GPU hidden: the same on every machine
        monkeypatch.setenv(var, "")
    extra = {"backends": [], "run": ["--no-corpus", "--examples", "1"],
             "repro": [str(workspace / "case.json")]}[command]
    refused([command, "--device", "cuda", "--artifacts", str(workspace / "art"), *extra],
            workspace, f"difftest {command}: error: --device cuda, but no GPU is visible (")


# ----- names from files and plug-ins -------------------------------------------------------

FAKE_VERDICT = "GATE PASSED: forged by a name"


def test_a_case_name_that_would_print_a_line_is_refused(workspace: Path) -> None:
    """A case file's name holding a newline and a verdict printed a fake verdict line and
    was carried into reports."""
    named = workspace / "named.json"
    named.write_text(json.dumps(TINY.to_dict() | {"name": f"x\n{FAKE_VERDICT}"}))
    for argv in (["promote", str(named), "x", "--corpus", str(workspace / "corpus")],
                 ["repro", str(named), "--artifacts", str(workspace / "art")]):
        refused(argv, workspace, f"{named}: name: = ",
                "(allowed: printable text of at most 1000 characters")


def test_names_from_a_report_are_printed_escaped(workspace: Path, report_text: str,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """Case names, ids and backend names of a report print on one line each, escaped: no
    report can print a verdict line of its own."""
    report = json.loads(report_text)
    report["cases"][0]["name"] = report["cases"][0]["case"]["name"] = f"x\n{FAKE_VERDICT}"
    from difftest.results.records import ResultRecord, Status

    report["cases"][0]["results"].append(
        ResultRecord(f"kern\r{FAKE_VERDICT}", Status.DISAGREE).to_dict())
    path = tmp_path_factory.mktemp("named") / "named.json"
    path.write_text(json.dumps(report))
    out = tmp_path_factory.mktemp("out")
    for argv in (["gate", str(path), str(path), "--all"],
                 ["merge", str(path), "-o", str(out / "m.json")], ["audit", str(path)]):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            cli.main(argv)
        lines = (stdout.getvalue() + stderr.getvalue()).splitlines()
        assert not any(line.startswith(FAKE_VERDICT) for line in lines), (argv, lines)
        assert any("x\\nGATE PASSED" in line for line in lines) or argv[0] != "gate", lines
    refused(["run", "--cases-from", str(path), "--artifacts", str(workspace / "art")],
            workspace, f"{path}: cases[0].case: name: = ")


@pytest.mark.parametrize(("plugin", "text"), [
    ("NAME_BACKENDS", "backend name 'ok\\nGATE PASSED: no regression' is not allowed "
                      "(allowed: printable text without spaces)"),
    ("VERSION_BACKENDS", "backend 'bad-versions': versions() returned {'torch': {1, 2}}, which "
                         "a report cannot hold (allowed: a mapping of strings to strings)"),
])
@pytest.mark.parametrize("command", ["backends", "run"])
def test_a_plugin_whose_name_or_versions_no_report_can_hold_is_refused(
        workspace: Path, plugin: str, text: str, command: str, device_name: str) -> None:
    """A plug-in whose ``versions()`` returned a set ended the run with a traceback while
    the report was written (exit 1)."""
    spec = f"{Path(__file__).parent / 'fake_backends.py'}:{plugin}"
    extra = (["--no-corpus", "--examples", "1", "--artifacts", str(workspace / "art"),
              "--report", str(workspace / "earlier.json")] if command == "run" else [])
    refused([command, "--device", device_name, "--plugin", spec, *extra], workspace,
            f"difftest {command}: error: --plugin {spec}: ", text)


# ----- files of the wrong kind, a bad environment ----------------------------------------

def test_a_directory_where_a_report_belongs_is_named(workspace: Path, report_text: str) -> None:
    """``run --cases-from DIR`` ended in a traceback, and a directory opened as a file said
    ``[Errno 21] Is a directory: 3`` (the descriptor, not the path)."""
    good = workspace / "good.json"
    good.write_text(report_text)
    folder = workspace / "corpus"
    refused(["run", "--cases-from", str(folder)], workspace,
            f"argument --cases-from: {folder}: is a directory (allowed: a regular file)")
    for argv in _all_readers(folder, good, workspace)[1:]:  # repro takes a directory
        refused(argv, workspace, str(folder))


def test_a_malformed_expectations_file_is_named(workspace: Path, report_text: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                device_name: str) -> None:
    good = workspace / "good.json"
    good.write_text(report_text)
    bad = workspace / "expectations.json"
    for text, problem in (("{", "not JSON"), ('{"expectations": [{"finding": "F1"}]}',
                                              "expectations[0]: missing field 'backends'")):
        bad.write_text(text)
        monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(bad))
        for argv in (["run", "--no-corpus", "--examples", "1", "--device", device_name,
                      "--backends", "torch-ref", "--artifacts", str(workspace / "art")],
                     ["merge", str(good), "-o", str(workspace / "m.json")],
                     ["audit", str(good)]):
            refused(argv, workspace, f"difftest {argv[0]}: error: {bad}", problem)


def _plot(path: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftest.cli", "plot", str(path), "-o",
                           str(out)], capture_output=True, text=True, timeout=120,
                          env=os.environ | env)


def test_a_broken_matplotlib_is_named(workspace: Path, report_text: str) -> None:
    """A bad ``MPLBACKEND`` or a matplotlib that fails to import ended in a traceback."""
    pytest.importorskip("matplotlib")
    good = workspace / "good.json"
    good.write_text(report_text)
    broken = workspace / "broken"
    (broken / "matplotlib").mkdir(parents=True)
    (broken / "matplotlib" / "__init__.py").write_text("raise AttributeError('no ft2font')\n")
    with untouched(workspace):
        for env, text in (({"MPLBACKEND": "bogus"}, "matplotlib fails to load "
                           "(MPLBACKEND='bogus'): ValueError: "),
                          ({"PYTHONPATH": str(broken)}, "matplotlib fails to load: "
                           "AttributeError: no ft2font")):
            done = _plot(good, workspace / "p.png", env)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert f"difftest plot: {text}" in done.stderr, done.stderr


# ----- the memory a parse takes ----------------------------------------------------------

def _parse_peak(path: Path) -> tuple[float, BaseException | None]:
    """The peak of Python's allocations while :func:`read_report` reads ``path``, as a
    multiple of its size, and what it raised."""
    import tracemalloc

    from difftest.reporting.report import read_report

    raised = None
    tracemalloc.start()
    try:
        read_report(path)
    except Exception as exc:  # the refusal measured
        raised = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / path.stat().st_size, raised


def test_parsing_takes_a_small_multiple_of_the_file(workspace: Path, report_text: str) -> None:
    """Reading any report took the 1 GiB cap besides its size (``read(limit + 1)`` allocates
    what it asks for: a 30 MB report took 1.07 GB), and a report of tiny arrays 21 times its
    size in Python objects, so the cap allowed about 23 GB. Now a file is read at its size,
    numbers parse into shared objects, and a text whose parse would pass 10 times its size is
    refused before it is parsed (``difftest/primitives/jsonfile.py``)."""
    report = json.loads(report_text)
    case = report["cases"][0]
    copies = []
    for n in range(400):  # a report of 400 cases
        entry = copy.deepcopy(case)
        entry["case_id"] = entry["case"]["id"] = f"{n:016x}"
        copies.append(entry)
    report["cases"] = copies
    real = workspace / "many.json"
    real.write_text(json.dumps(report, indent=1))
    factor, raised = _parse_peak(real)
    assert raised is None and factor < 8, factor  # measured 3.3; before, 2100 (the cap)
    hostile = workspace / "tiny-arrays.json"
    hostile.write_text("[" + ",".join(["[]"] * 1_000_000) + "]")
    factor, raised = _parse_peak(hostile)
    assert isinstance(raised, Exception) and "times its" in str(raised), raised
    assert factor < 4, factor  # refused on counts: measured 2.0; parsed, 23


# ----- a failure directory from elsewhere ------------------------------------------------

class PathKernel:
    """A backend whose ``vllm=`` option names a directory whose code it runs, as
    ``triton-unified[vllm=DIR]`` loads a release's kernel files from ``DIR``."""

    def __init__(self, path: str = "") -> None:
        from tests.fake_backends import Rounded

        self.inner, self.path = Rounded(), path
        self.name = f"path-kernel[vllm={path}]" if path else "path-kernel"
        self.in_page_orders = ()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def with_options(self, options: dict[str, str]) -> PathKernel:
        return PathKernel(options["vllm"])

    def run(self, inputs: Any) -> Any:
        if self.path:
            runpy.run_path(str(Path(self.path) / "vllm" / "__init__.py"))
        return self.inner.run(inputs)


def test_repro_runs_no_recorded_path_option_unless_the_command_line_trusts_it(
        workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        device_name: str) -> None:
    """``difftest repro DIR`` rebuilt the recorded backend names with their options: a
    ``results.json`` naming ``triton-unified[vllm=<a folder inside DIR>]`` made the replay
    import and run that folder's Python, with no ``--plugin`` given. Such names are now left
    out unless ``--backends`` names them or ``--trust-recorded-paths`` is given."""
    from difftest.backends.torch_ref import TorchReference
    from difftest.results.features import case_features
    from difftest.results.records import CaseRecord, ResultRecord, Status

    directory = workspace / "art" / "failures" / TINY.case_id
    evil = directory / "evil"
    (evil / "vllm").mkdir(parents=True)
    marker = workspace / "ran-the-recorded-code"
    (evil / "vllm" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    name = f"path-kernel[vllm={evil}]"
    (directory / "results.json").write_text(json.dumps(CaseRecord(
        case_id=TINY.case_id, name="", case=TINY.to_dict(), features=case_features(TINY),
        reference="torch-ref", results=[ResultRecord(name, Status.AGREE)]).to_dict()))
    # installed: the reference and the path-taking kernel, so a replay runs what it records
    monkeypatch.setattr(registry, "entry_point_backends",
                        lambda: [TorchReference(), PathKernel()])
    options = ["--device", device_name, "--artifacts", str(workspace / "replays")]
    assert cli.main(["repro", str(directory), *options]) == 0
    out = capsys.readouterr().out
    assert f"(not run: its option vllm={evil} names a path, whose code the recording cannot " \
           "vouch for; name it with --backends, or pass --trust-recorded-paths, to run it)" in out
    assert not marker.exists()
    assert cli.main(["repro", str(directory), "--trust-recorded-paths", *options]) == 0
    assert marker.exists() and "not run: its option" not in capsys.readouterr().out
    marker.unlink()
    assert cli.main(["repro", str(directory), "--backends", name, *options]) == 0
    assert marker.exists()
