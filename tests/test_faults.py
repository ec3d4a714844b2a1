"""Faults a user's worst day brings: backends that cannot run, damaged state on disk, the
umask, pasted commands, a missing optional library, plug-ins named from the console script,
and real signals to real processes: Ctrl-C, SIGTERM, a killed job, a killed parent, a full
disk (a file-size limit), an unwritable report.

Each test sets up the fault for real (files written as a dead or foreign process would leave
them, a backend whose probe fails) and checks the run's exit status and what it printed:
never a silent pass, never a traceback.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.results.artifacts import ArtifactStore, promote_command, repro_command, running_path
from difftest.run.replay import report_previous_crashes

FAKES = Path(__file__).parent / "fake_backends.py"
TINY = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),), seed=4)
REPO = Path(__file__).parents[1]


def _run(tmp_path: Path, device_name: str, *options: str) -> list[str]:
    return ["run", "--no-corpus", "--examples", "1", "--device", device_name, "--plugin",
            f"{FAKES}:FAULTY_BACKENDS", "--artifacts", str(tmp_path / "art"), *options]


# ----- backends that were asked for and could not run -----------------------------------

def test_an_asked_for_backend_that_cannot_run_fails_the_run(tmp_path, capsys,
                                                            device_name) -> None:
    code = cli.main(_run(tmp_path, device_name, "--backends", "rounded,probe-raises"))
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1
    assert ("FAILED: backend probe-raises was asked for and could not run: "
            "its availability probe raised RuntimeError") in out[-2]
    assert "(mark it --optional probe-raises to run without it)" in out[-2]
    assert out[-1].startswith("FAILED: 0 new failure(s)")  # the verdict line, last
    assert "1 asked-for backend(s) could not run" in out[-1]


def test_an_asked_for_backend_that_ran_no_case_fails_the_run(tmp_path, capsys,
                                                              device_name) -> None:
    """``--backends aiter-gluon@emulated --cases-from R`` where it supported no case printed
    ``PASSED: 3 cases, 0 agreements`` (exit 0): a run that tested nothing it was asked to is
    no pass."""
    code = cli.main(_run(tmp_path, device_name, "--backends", "rounded,support-refuses",
                         "--plugin", f"{FAKES}:REFUSING_BACKENDS"))
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1
    assert out[-2] == ("FAILED: backend support-refuses was asked for and ran no case: all 1 "
                       "of its cases were unsupported (mark it --optional support-refuses to "
                       "run without it)")
    assert out[-1].startswith("FAILED: 0 new failure(s) in 1 cases; 1 asked-for backend(s) "
                              "could not run or ran no case;")
    assert cli.main(_run(tmp_path, device_name, "--backends", "rounded,support-refuses",
                         "--plugin", f"{FAKES}:REFUSING_BACKENDS", "--optional",
                         "support-refuses")) == 0


def test_a_full_disk_while_noting_the_running_backend_is_no_kernels_error(
        tmp_path, capsys, monkeypatch, device_name) -> None:
    """The note naming the running backend was written inside the guard around the kernel: a
    full disk there became the backend's ``error`` (FAILED, a new failure per backend); now
    the run stops with exit 2 naming the file, and leaves no pending case to blame anyone."""
    def full(self: ArtifactStore, case: Case, backend: str) -> None:
        raise OSError(28, f"cannot write {self._running_path(case)}: No space left on device")

    monkeypatch.setattr(ArtifactStore, "running", full)
    code = cli.main(_run(tmp_path, device_name, "--backends", "rounded"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "difftest run: error: [Errno 28] cannot write " in err and ".running: No space" in err
    assert _pending_files(tmp_path) == []
    monkeypatch.undo()
    assert report_previous_crashes(str(tmp_path / "art"), "the next run") == []


def test_an_optional_backend_may_be_unavailable(tmp_path, capsys, device_name) -> None:
    code = cli.main(_run(tmp_path, device_name, "--backends", "rounded,probe-raises",
                         "--optional", "probe-raises"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "FAILED" not in captured.out + captured.err
    assert captured.out.strip().splitlines()[-1].startswith("PASSED")


@pytest.mark.parametrize("optional", [False, True], ids=["asked", "optional"])
def test_a_pytest_session_fails_when_an_asked_for_backend_cannot_run(
        tmp_path: Path, optional: bool) -> None:
    """``pytest --difftest-backends`` naming a backend that cannot run passed: every test ran
    on the others, and nothing said the asked-for kernel was never tested."""
    (tmp_path / "test_tiny.py").write_text(PYTEST_CASES)
    marked = ["--difftest-optional", "probe-raises"] if optional else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--difftest-plugin",
         f"{FAKES}:FAULTY_BACKENDS", "--difftest-backends", "rounded,probe-raises",
         "--difftest-device", "cpu", *marked, "test_tiny.py"], cwd=tmp_path,
        capture_output=True, text=True, timeout=LIMIT,
        env=os.environ | {"OMP_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": "ci"})
    lines = proc.stdout.strip().splitlines()
    verdict = next(line for line in reversed(lines) if line.startswith(("PASSED", "FAILED")))
    if optional:
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert verdict.startswith("PASSED")
    else:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert ("FAILED: backend probe-raises was asked for and could not run: its "
                "availability probe raised RuntimeError") in proc.stdout
        assert "1 asked-for backend(s) could not run" in verdict


# ----- damaged pending state --------------------------------------------------------------

def _pending(root: Path) -> Path:
    """A pending file as a process that died would leave it (the pid of one that exited)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    store = ArtifactStore(root)
    written = store.begin(TINY, ["torch-ref", "rounded"])
    payload = json.loads(written.read_text()) | {"pid": dead.pid}
    target = written.with_name(f"{TINY.case_id}.{dead.pid}.json")
    target.write_text(json.dumps(payload))
    written.unlink()
    return target


@pytest.mark.parametrize(("damage", "problem"), [
    ("truncate", "not JSON"),
    ("garbage", "not JSON"),
    ("empty", "empty (not JSON)"),
    ("newer", "schema"),
    ("no-backends", "backends: [] (allowed: a non-empty list of names, the reference first)"),
    ("running-not-utf8", "not UTF-8 text"),
])
def test_a_damaged_pending_file_is_reported_with_its_path(tmp_path, capsys, damage,
                                                          problem) -> None:
    """Each was skipped in silence forever, or (empty backends, a non-UTF-8 note) made every
    later run die with a traceback until deleted by hand."""
    path = _pending(tmp_path)
    payload = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:40])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01garbage")
    elif damage == "empty":
        path.write_text("")
    elif damage == "newer":
        payload["case"]["schema"] = "difftest.case/9"
        path.write_text(json.dumps(payload))
    elif damage == "no-backends":
        path.write_text(json.dumps(payload | {"backends": []}))
    else:
        running_path(path).write_bytes(b"\xff\xfe\x00rounded")
    assert report_previous_crashes(str(tmp_path), "difftest run") == []
    err = capsys.readouterr().err
    assert f"WARNING damaged pending file {path}: " in err and problem in err, err
    assert "look at it, then delete it" in err
    assert path.exists()  # kept for the user to look at


def test_a_pending_file_of_a_dead_process_still_becomes_a_crash(tmp_path, capsys) -> None:
    path = _pending(tmp_path)
    running_path(path).write_text("rounded")
    [record] = report_previous_crashes(str(tmp_path), "difftest run")
    assert record.results[0].backend == "rounded" and record.results[0].status.value == "crash"
    assert "WARNING" not in capsys.readouterr().err
    assert not path.exists()


# ----- what a user pastes and what files they get -----------------------------------------

@pytest.mark.parametrize("path", ["art dir/failures/0123", "a;touch pwned/failures/x",
                                  "it's/$(id)/x"])
def test_printed_commands_paste_back_to_the_same_words(path: str) -> None:
    plugins = ("my plugins/file.py", "mod;rm -rf x:ATTR")
    assert shlex.split(repro_command(path, plugins)) == [
        "difftest", "repro", path, "--plugin", plugins[0], "--plugin", plugins[1]]
    assert shlex.split(promote_command(path, "a name")) == ["difftest", "promote", path,
                                                            "a name"]


def test_a_pasted_replay_command_runs_nothing_else(tmp_path: Path) -> None:
    """Through a real shell: the text after a ``;`` in a path stays part of the path."""
    command = repro_command(f"{tmp_path}/x;touch {tmp_path}/pwned")
    done = subprocess.run(["sh", "-c", command.replace("difftest", "echo", 1)],
                          capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == f"repro {tmp_path}/x;touch {tmp_path}/pwned"
    assert not (tmp_path / "pwned").exists()


def test_reports_and_artifacts_keep_the_users_umask(tmp_path: Path) -> None:
    """Atomic writes went through mkstemp's 0600 whatever the umask."""
    from difftest.primitives.jsonfile import write_json

    old = os.umask(0o022)
    try:
        report = write_json(tmp_path / "report.json", {"a": 1})
        store = ArtifactStore(tmp_path / "art")
        pending = store.begin(TINY, ["torch-ref", "rounded"])
        os.umask(0o077)
        private = write_json(tmp_path / "private.json", {})
    finally:
        os.umask(old)
    assert report.stat().st_mode & 0o777 == 0o644
    assert pending.stat().st_mode & 0o777 == 0o644
    assert private.stat().st_mode & 0o777 == 0o600


def test_plot_without_matplotlib_is_one_line_naming_what_to_install(tmp_path, capsys,
                                                                    monkeypatch) -> None:
    from difftest.reporting.report import build_report

    report = tmp_path / "r.json"
    from difftest.primitives.jsonfile import write_json

    write_json(report, build_report([], {}, {"runner": "test"}, {"versions": {}}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["plot", str(report)]) == 2
    err = capsys.readouterr().err
    assert err == ("difftest plot: matplotlib is not installed (pip install "
                   "'difftest[plot]', or pip install matplotlib)\n")


def test_a_module_plugin_in_the_current_directory_loads_from_the_console_script(
        tmp_path: Path) -> None:
    """The README's ``--plugin mutants.catalog``, run as the installed ``difftest`` script
    from the checkout (whose ``sys.path`` lacks the current directory)."""
    script = Path(sys.executable).with_name("difftest")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (difftest not installed)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(script), "backends", "--device", "cpu", "--plugin",
                           "mutants.catalog"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "triton-unified!page-stride-8" in done.stdout


# ----- interrupts, kills, full disks: real signals to real processes ----------------------

SLOW = '''
import os
import time
from pathlib import Path

import torch

from difftest.contract.backend import Precision, RunInputs
from difftest.backends.torch_ref import TorchReference

MARKS = Path(os.environ["SLOW_MARKS"])
calls = 0


class Slow(TorchReference):
    """Disagrees on its first case; on its second, the first process to get there notes its
    pid and sleeps (a kernel that hangs), so a test can signal it mid-case."""

    name = "slow"

    def precision(self, case, device):
        return Precision("float16", "float16", "float16")

    def run(self, inputs: RunInputs) -> torch.Tensor:
        global calls
        calls += 1
        out = self.reference(inputs).output.to(torch.float16)
        if calls == 1:
            out[0, 0, 0] += 1.0
        elif calls == 2 and os.environ.get("SLOW_ALL") or calls == 2 and _first():
            (MARKS / f"sleeping-{os.getpid()}").write_text("")
            time.sleep(float(os.environ.get("SLOW_SECONDS", "300")))
        return out


def _first() -> bool:
    try:
        os.close(os.open(MARKS / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


DIFFTEST_BACKENDS = [Slow]
'''
LIMIT = 240  # seconds any one subprocess of these tests may take


def _slow_run(tmp_path: Path, *options: str, env: dict[str, str] | None = None,
              **popen: object) -> tuple[subprocess.Popen[str], Path, Path]:
    """``difftest run`` of 4 generated cases on the ``slow`` backend, started; returns the
    process, its report path and the directory where ``slow`` notes its sleeping pid."""
    plugin, marks = tmp_path / "slow.py", tmp_path / "marks"
    plugin.write_text(SLOW)
    marks.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "difftest.cli", "run", "--no-corpus", "--examples", "4",
         "--device", "cpu", "--plugin", str(plugin), "--backends", "slow", "--artifacts",
         str(tmp_path / "art"), "--report", str(report), *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=os.environ | {"SLOW_MARKS": str(marks), "OMP_NUM_THREADS": "1"} | (env or {}),
        **popen)
    return proc, report, marks


def _sleeper(marks: Path, proc: subprocess.Popen[str]) -> int:
    """The pid ``slow`` noted once it sleeps mid-case (fails if the run ended first)."""
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        found = list(marks.glob("sleeping-*"))
        if found:
            return int(found[0].name.split("-")[1])
        if proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before sleeping: "
                        f"{proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the slow backend never started sleeping")


def test_a_signal_python_drops_in_a_gc_callback_still_ends_the_run(capfd) -> None:
    """SIGINT landing in a garbage-collector callback (Hypothesis registers one) printed a
    traceback there, was lost, and the job ran on until its parent killed it."""
    import gc

    from difftest.primitives import interrupts

    def callback(phase: str, _info: dict) -> None:
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs inside the callback

    with interrupts.catching_signals():
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        with pytest.raises(interrupts.Interrupted) as caught:
            interrupts.raise_pending()
    assert caught.value.name == "SIGINT"
    interrupts.raise_pending()  # outside, nothing is pending
    assert "Traceback" not in capfd.readouterr().err


def _pending_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "art" / "pending").glob("*"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_run_writes_a_partial_report_and_blames_no_kernel(
        tmp_path: Path, signum: int) -> None:
    """Ctrl-C printed a 60-line traceback, wrote no report and left the pending file, so the
    next run reported a crash of the backend; SIGTERM the same, silently; SIGHUP (a closed
    terminal, a CI agent that lost its session) too, after SIGINT and SIGTERM were handled."""
    proc, report, marks = _slow_run(tmp_path)
    _sleeper(marks, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=LIMIT)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if "interrupted by" in x]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"difftest run: interrupted by {name}: 1 finished case(s) in a "
                           f"partial report ({report})")
    written = json.loads(report.read_text())
    assert written["config"]["interrupted"]["signal"] == name
    [in_flight] = written["config"]["interrupted"]["in_flight"]
    assert in_flight["running"] == "slow"
    [case] = written["cases"]  # the finished one, with its disagreement
    assert case["results"][0]["status"] == "disagree"
    assert in_flight["case_id"] != case["case_id"]
    assert _pending_files(tmp_path) == []
    assert report_previous_crashes(str(tmp_path / "art"), "the next run") == []


PYTEST_CASES = '''
import pytest
from difftest.case.spec import Case


@pytest.mark.parametrize("seed", range(3))
def test_tiny(seed, check_case):
    check_case(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                    selections=((0, 1),), seed=seed))
'''


def _default_sigint() -> None:
    """In the child before it execs: SIGINT back to its default action. A shell starts a
    background job with SIGINT ignored, the child inherits that, and Python then installs no
    KeyboardInterrupt handler: pytest, like any program so started, keeps running."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_pytest_session_blames_no_kernel(tmp_path: Path, signum: int) -> None:
    """A pytest session stopped mid-case (Ctrl-C; a CI timeout's SIGINT or SIGTERM; a closed
    terminal's SIGHUP) left the case pending, and the next run reported it as a crash of the
    backend that was running; the report did not say which case the signal stopped."""
    (tmp_path / "slow.py").write_text(SLOW)
    (tmp_path / "test_tiny.py").write_text(PYTEST_CASES)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--difftest-plugin",
         "slow.py", "--difftest-backends", "slow", "--difftest-report", "report.json",
         "test_tiny.py"], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"SLOW_MARKS": str(marks), "OMP_NUM_THREADS": "1",
                          "HYPOTHESIS_PROFILE": "ci"}, preexec_fn=_default_sigint)
    _sleeper(marks, proc)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 2, out[-3000:]  # pytest's "interrupted"
    art = tmp_path / "difftest-artifacts"
    assert sorted((art / "pending").glob("*")) == []
    assert report_previous_crashes(str(art), "the next run") == []
    stopped = json.loads((tmp_path / "report.json").read_text())["config"]["interrupted"]
    assert stopped["signal"] == signal.Signals(signum).name
    [in_flight] = stopped["in_flight"]
    assert in_flight["running"] == "slow"


def test_a_killed_job_loses_none_of_its_finished_cases(tmp_path: Path) -> None:
    """Under --jobs 2, SIGKILL of one job: its finished cases (a disagreement among them)
    were missing from the report, and its crash was labelled an earlier run's."""
    proc, report, marks = _slow_run(tmp_path, "--jobs", "2")
    victim = _sleeper(marks, proc)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 1, err[-3000:]
    written = json.loads(report.read_text())
    statuses = sorted(c["results"][0]["status"] for c in written["cases"])
    assert len(written["cases"]) == 4, statuses
    assert statuses.count("disagree") == 2  # each job's first case, the killed one's too
    assert statuses.count("crash") == 1
    assert "earlier_crashes" not in written
    assert "(a job of this run died in it)" in err
    assert "taken from their records" in err
    assert list((tmp_path / "art" / "jobs").iterdir()) == []


@pytest.mark.parametrize("group", [False, True], ids=["parent", "terminal"])
def test_an_interrupted_jobs_run_merges_the_jobs_partial_reports(tmp_path: Path,
                                                                 group: bool) -> None:
    """Ctrl-C under --jobs printed three interleaved tracebacks and wrote nothing. Sent to
    the parent, it passes the signal on to its jobs; a terminal's Ctrl-C reaches the whole
    process group, so each job gets it twice (a second one interrupted the first's cleanup
    and left a false crash)."""
    proc, report, marks = _slow_run(tmp_path, "--jobs", "2", env={"SLOW_ALL": "1"},
                                    start_new_session=group)
    _sleeper(marks, proc)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert len([x for x in err.splitlines() if "interrupted by SIGINT" in x]) == 1, err
    written = json.loads(report.read_text())
    assert "disagree" in {c["results"][0]["status"] for c in written["cases"]}
    assert "crash" not in {c["results"][0]["status"] for c in written["cases"]}
    stopped = written["config"]["interrupted"]
    assert stopped["signal"] == "SIGINT"
    assert "slow" in {case["running"] for case in stopped["in_flight"]}
    assert _pending_files(tmp_path) == []
    assert list((tmp_path / "art" / "jobs").iterdir()) == []


def test_a_killed_parent_takes_its_jobs_along_and_the_next_run_cleans_up(
        tmp_path: Path) -> None:
    """SIGKILL of the parent of --jobs leaked its temporary directory (and its jobs ran on)."""
    from difftest.run.jobs import _remove_orphans

    proc, _, marks = _slow_run(tmp_path, "--jobs", "2", env={"SLOW_ALL": "1"})
    job = _sleeper(marks, proc)
    proc.kill()
    proc.communicate(timeout=LIMIT)
    deadline = time.monotonic() + LIMIT
    while Path(f"/proc/{job}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the job got SIGTERM with its parent (PR_SET_PDEATHSIG)
    assert not Path(f"/proc/{job}").exists()
    root = tmp_path / "art" / "jobs"
    [left] = list(root.iterdir())
    assert left.name.startswith(f"{proc.pid}.")
    _remove_orphans(root)
    assert list(root.iterdir()) == []


def test_jobs_run_the_parents_difftest_not_the_current_directorys(tmp_path: Path) -> None:
    """A directory holding a ``difftest/cli.py`` ran that in every job."""
    script = Path(sys.executable).with_name("difftest")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (difftest not installed)")
    impostor = tmp_path / "cwd" / "difftest"
    impostor.mkdir(parents=True)
    (impostor / "__init__.py").write_text("")
    (impostor / "cli.py").write_text("import sys\nprint('IMPOSTOR')\nsys.exit(3)\n")
    done = subprocess.run(
        [str(script), "run", "--no-corpus", "--examples", "2", "--device", "cpu", "--jobs",
         "2", "--plugin", f"{FAKES}", "--backends", "rounded", "--artifacts",
         str(tmp_path / "art")], cwd=impostor.parent, capture_output=True, text=True,
        timeout=LIMIT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert "IMPOSTOR" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-3000:]


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_names_the_file_and_leaves_no_false_crash(tmp_path: Path) -> None:
    """Writing a failure directory on a full disk aborted with ``[Errno 28]`` naming no
    path, and left the pending file, which the next run turned into a crash of the backend.
    The disk is a file-size limit (RLIMIT_FSIZE): the pending file fits, results.json
    (twice its size for this case) does not."""
    from difftest.results.artifacts import ArtifactStore as Store

    pending = Store(tmp_path / "probe", plugins=(str(FAKES),)).begin(
        TINY, ["torch-ref", "perturbed"])
    (tmp_path / "case.json").write_text(TINY.to_json())
    art = tmp_path / "art"
    done = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "repro", str(tmp_path / "case.json"),
         "--device", "cpu", "--plugin", str(FAKES), "--backends", "perturbed",
         "--artifacts", str(art)], cwd=REPO, capture_output=True, text=True,
        timeout=LIMIT, preexec_fn=_limit_file_size(pending.stat().st_size + 500),
        env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    results = art / "replays" / "failures" / TINY.case_id / "results.json"
    assert f"difftest repro: error: [Errno 27] cannot write {results}: File too large" in (
        done.stderr)
    assert sorted((art / "replays" / "pending").glob("*")) == []
    assert report_previous_crashes(str(art), "the next run") == []


def test_an_unwritable_report_is_refused_before_the_first_case(tmp_path, capsys,
                                                               device_name) -> None:
    """A read-only report location was found only after every case ran, naming the
    temporary file; the results were lost."""
    report = "/proc/difftest-report.json"
    code = cli.main(_run(tmp_path, device_name, "--backends", "rounded", "--report", report))
    err = capsys.readouterr().err
    assert code == 2
    assert f"difftest run: error: [Errno 2] cannot write {report} " in err
    assert not (tmp_path / "art" / "pending").exists()


def test_a_run_under_nohup_keeps_ignoring_sighup() -> None:
    """SIGHUP ends a run like SIGTERM, except where the process was started to outlive its
    terminal (``nohup``: SIGHUP ignored), which it still does."""
    from difftest.primitives import interrupts

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupts.catching_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with interrupts.catching_signals():
            assert callable(signal.getsignal(signal.SIGHUP))
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
