"""The active side of the difftest pytest plugin: profiles, GPU pinning, runs, crashes, reports.

:mod:`difftest.pytest_plugin` (the ``pytest11`` entry point) imports this module only when
difftest is in use in a pytest run, so a foreign project's pytest in the same environment never
imports torch or changes its Hypothesis settings. ``check_case(case)`` runs a case on the
configured backends and fails with every disagreement's message and the command that replays
it. A process plays one of three roles:

* **single** (no xdist): runs the cases on the chosen device and writes the report.
* **controller** (``pytest -n N``): never touches a GPU runtime. It counts GPUs from driver
  files (:mod:`difftest.machine.devices`), gives each worker one through ``workerinput``
  (:func:`difftest.machine.pinning.assign`, round-robin when workers outnumber GPUs), turns the case
  a dead worker left pending into a crash artifact, and joins the workers' run logs into the
  report and the terminal summary.
* **worker**: sets its GPU visibility in ``pytest_configure``, before any test module or
  backend can start a runtime, runs cases and appends each result to its run log
  (``<artifacts>/runs/<run>/<worker>.jsonl``, flushed per case, so a crash loses nothing).

Hypothesis profiles are registered as ``difftest-ci``, ``difftest-dev`` and
``difftest-nightly`` and one is loaded (chosen by ``HYPOTHESIS_PROFILE=ci|dev|nightly``, by
default ``ci`` when ``CI`` is set, else ``dev``) unless ``--hypothesis-profile`` was given.
The example database of ``dev`` and ``nightly`` is one directory, resolved to the same
absolute path in every worker; Hypothesis writes each entry with an atomic rename, so workers
share it safely.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.strategies import SearchStrategy

from difftest.case.spec import Case
from difftest.contract.registry import split_names
from difftest.generation.capabilities import Capabilities
from difftest.judgement.audit import audit_json
from difftest.judgement.expectations import Expectation, judge
from difftest.judgement.expectations import load as load_expectations
from difftest.machine import devices, pinning
from difftest.machine.bytecode import uncompiled_note
from difftest.machine.fingerprint import fingerprint
from difftest.machine.kernel_compiles import describe, kernel_cache_dir
from difftest.machine.kernel_compiles import merged as merged_compiles
from difftest.primitives.jsonfile import dumps, loads
from difftest.reporting.report import (
    Report,
    blind_spot_lines,
    case_records,
    summary,
    unavailable_asked,
    unique_cases,
    verdict_line,
    write_report,
)
from difftest.results.artifacts import DEFAULT_ROOT, ArtifactStore, promote_command, repro_command
from difftest.results.records import CaseRecord
from difftest.run.runner import CaseResult
from difftest.run.session import DEFAULT_REFERENCE, Session
from difftest.run.shard import Shard, ShardError, shard_of

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
PROFILES: tuple[str, ...] = ("ci", "dev", "nightly")
PROFILE_ENV = "HYPOTHESIS_PROFILE"
PLUGIN_NAME = "difftest-run"
BUDGET_PROPERTY = "difftest:search-budget"
WORKER_GPU_FIELDS = ("gpu_name", "gpu_arch", "gpu_pci_bus_id")
_REPRODUCE_FAILURE = re.compile(r"@reproduce_failure\([^)]*\)|--hypothesis-seed=\S+|@seed\(\d+\)")
# seconds a generated test searches in each profile before it stops (None: no budget): the dev
# profile's search is random, and over interpreted kernels on a loaded box it can run for
# half an hour; ci draws a fixed 25 examples and nightly is meant to go deep
SEARCH_BUDGETS: dict[str, float | None] = {"ci": None, "dev": 240.0, "nightly": None}
_DEFAULTS: dict[str, Any] = {"--difftest-device": "auto", "--difftest-plugin": [],
                             "--difftest-reference": DEFAULT_REFERENCE,
                             "--difftest-artifacts": DEFAULT_ROOT}


def option(config: pytest.Config, name: str) -> Any:
    """The value of ``--difftest-*`` option ``name``, its default when not given."""
    value = config.getoption(name)
    return _DEFAULTS.get(name) if value is None else value


def register_profiles() -> None:
    """Register ``difftest-ci``, ``difftest-dev`` and ``difftest-nightly`` (loads none)."""
    database = DirectoryBasedExampleDatabase(Path(".hypothesis/examples").resolve())
    settings.register_profile(
        "difftest-ci", derandomize=True, max_examples=25, deadline=None, database=None,
        print_blob=True, suppress_health_check=_SLOW)
    settings.register_profile(
        "difftest-dev", max_examples=50, deadline=None, print_blob=True,
        suppress_health_check=_SLOW, database=database)
    settings.register_profile(
        "difftest-nightly", max_examples=2000, deadline=None, print_blob=True,
        suppress_health_check=_SLOW, phases=list(Phase), database=database)


def chosen_profile(environ: Mapping[str, str] = os.environ) -> str:
    """``ci``, ``dev`` or ``nightly`` from ``HYPOTHESIS_PROFILE`` (default by ``CI``)."""
    name = environ.get(PROFILE_ENV, "ci" if environ.get("CI") else "dev")
    if name not in PROFILES:
        raise pytest.UsageError(f"difftest: {PROFILE_ENV}={name!r} is not a difftest profile "
                                f"(allowed: {', '.join(PROFILES)})")
    return name


def _load_profile(config: pytest.Config, shard: Shard | None) -> str | None:
    """Load the chosen difftest profile, unless ``--hypothesis-profile`` chose one."""
    if config.getoption("--hypothesis-profile", None):
        return None
    name = chosen_profile()
    profile = f"difftest-{name}"
    if shard is not None:  # a shard rejects most draws: that is no health problem
        settings.register_profile(
            f"{profile}-sharded", parent=settings.get_profile(profile),
            suppress_health_check=[*_SLOW, HealthCheck.filter_too_much])
        profile = f"{profile}-sharded"
    settings.load_profile(profile)
    return name


def search_budget(config: pytest.Config, profile: str | None) -> float | None:
    """``--difftest-search-budget`` in seconds, else the profile's (``None``: no budget)."""
    text = config.getoption("--difftest-search-budget")
    if text is None:
        return SEARCH_BUDGETS.get(profile) if profile else None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise pytest.UsageError(f"difftest: --difftest-search-budget={text!r} is not a number "
                                "of seconds (allowed: >= 0; 0: no budget)")
    return seconds or None


class SearchBudgetSpent(BaseException):
    """A generated test searched past its budget. A BaseException, so that Hypothesis stops
    at once instead of taking it for a failing example and shrinking it."""

    def __init__(self, examples: int, budget: float, failure: str | None) -> None:
        super().__init__(f"search stopped after {examples} example(s) at its {budget:g} s "
                         "budget (--difftest-search-budget SECONDS, 0: none)")
        self.failure = failure  # the first new failure of the test, when one was found


def _role(config: pytest.Config) -> str:
    if hasattr(config, "workerinput"):
        return "worker"
    if config.getoption("dist", "no") != "no" and not config.getoption("collectonly"):
        return "controller"
    return "single"


def _shard(config: pytest.Config) -> Shard | None:
    text = config.getoption("--difftest-shard")
    if text is None:
        return None
    try:
        return Shard.parse(text, "--difftest-shard")
    except ShardError as exc:
        raise pytest.UsageError(str(exc)) from exc


def _device(config: pytest.Config) -> str:
    device = option(config, "--difftest-device")
    if device not in devices.DEVICE_CHOICES:
        raise pytest.UsageError(f"difftest: --difftest-device {device!r} is not one of "
                                f"{', '.join(devices.DEVICE_CHOICES)}")
    return device


def _check_runner_mask(device: str) -> None:
    """Refuse a GPU visibility the workers could not honour, before anything starts."""
    try:
        vendor, physical = pinning.detect()
        pinning.assign(0, 1, pinning.runner_mask(), physical, vendor, device)
    except (pinning.PinningError, pinning.VisibilityError) as exc:
        raise pytest.UsageError(f"difftest GPU pinning: {exc}") from exc


def _check_backends(config: pytest.Config) -> None:
    """Refuse unknown backends, bad options and broken plug-ins before any test runs."""
    from difftest.contract import registry

    names = config.getoption("--difftest-backends")
    try:
        known = registry.discover(option(config, "--difftest-plugin"))
        registry.select(known, [option(config, "--difftest-reference"),
                                *(split_names(names) if names else [])])
    except registry.RegistryError as exc:
        raise pytest.UsageError(f"difftest: {exc}") from exc


def activate(config: pytest.Config) -> DifftestRun:
    """Start difftest in this process, from ``pytest_configure``.

    Pins a worker's GPU and prepares the CPU runtime before any test module imports vLLM,
    loads the Hypothesis profile, and checks the options in the single process or controller.
    """
    shard = _shard(config)
    device = _device(config)
    register_profiles()
    profile = _load_profile(config, shard)
    role = _role(config)
    gpu_env: dict[str, str] = {}
    if role == "worker":
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise pytest.UsageError("difftest: a GPU runtime started in this xdist worker "
                                    "before its GPU was pinned (a plugin or conftest "
                                    "initialised CUDA/HIP at import time)")
        gpu_env = dict(config.workerinput.get("difftest_gpu_env", {}))  # type: ignore[attr-defined]
        os.environ.update(gpu_env)
    else:
        _check_runner_mask(device)
    if role != "controller" and devices.resolve(device) == "cpu":
        devices.prepare_runtime("cpu")
    if role != "worker":  # after the CPU runtime: a plug-in may import vLLM as it loads
        _check_backends(config)
    _stop_on_sigterm()
    run = DifftestRun(config, role, shard, gpu_env, profile)
    config.pluginmanager.register(run, PLUGIN_NAME)
    return run


def _stop_on_sigterm() -> None:
    """Let SIGTERM (a CI job's timeout) and SIGHUP (a closed terminal, a CI agent that lost
    its session) stop pytest as Ctrl-C does, so that the case in flight is recorded as
    interrupted instead of being left pending for the next run to report as a crash. Only
    where the signal still has its default action, in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def activate_late(config: pytest.Config) -> DifftestRun:
    """Start difftest when a test asks for its fixture in a run that did not enable it.

    Too late to pin GPUs or choose a Hypothesis profile (both would change a run already
    under way): the process runs as a single process on the device ``auto`` resolves to.
    """
    _check_backends(config)
    device = devices.resolve(_device(config))
    if device == "cpu":
        devices.prepare_runtime("cpu")
    run = DifftestRun(config, "single", _shard(config), {}, None)
    config.pluginmanager.register(run, PLUGIN_NAME)
    return run


def current(config: pytest.Config) -> DifftestRun | None:
    """This process's :class:`DifftestRun`, ``None`` while difftest is not active."""
    plugin = config.pluginmanager.get_plugin(PLUGIN_NAME)
    return plugin if isinstance(plugin, DifftestRun) else None


class RunLog:
    """The JSON-lines log one process keeps of a pytest run (flushed after every line)."""

    def __init__(self, directory: Path, writer: str) -> None:
        self.path = directory / f"{writer}.jsonl"
        self.writer = writer

    def write(self, kind: str, **fields: Any) -> None:
        """Append one line ``{"kind": kind, "writer": ..., **fields}``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(dumps({"kind": kind, "writer": self.writer, **fields}) + "\n")

    @staticmethod
    def read(directory: Path) -> list[dict[str, Any]]:
        """Every complete line of every log under ``directory``, file by file (sorted by name).

        A last line without its newline is the append a process was killed in; it is dropped
        (the case it would have recorded is still pending, so it is reported as a crash). Any
        other unreadable line is an error naming the file and the line.
        """
        lines = []
        for path in sorted(directory.glob("*.jsonl")):
            *complete, _cut = path.read_text().split("\n")
            lines.extend(loads(text, f"{path} line {n}")
                         for n, text in enumerate(complete, start=1) if text.strip())
        return lines


def case_property(result: CaseResult) -> tuple[str, str]:
    """A JUnit property of one case: ``difftest:<case id>`` = ``backend=status(err/tol);...``,
    a failing result followed by its known bugs: ``[known F28]`` when they explain it wholly
    (the test does not fail on it), ``[new beyond F28]`` when more is wrong."""
    parts = []
    for r in result.results:
        ratio = f"({r.comparison.max_ratio:.3g})" if r.comparison else ""
        known = ""
        if r.known_bug is not None:
            kind = "new beyond" if r.known_bug.new_failure else "known"
            known = f"[{kind} {','.join(r.known_bug.names)}]"
        parts.append(f"{r.backend}={r.status.value}{ratio}{known}")
    return f"difftest:{result.case.case_id}", ";".join(parts)


def failure_text(result: CaseResult, plugins: tuple[str, ...] = ()) -> str:
    """Every failing backend's message, then how to replay the case and pin it."""
    text = "\n\n".join(result.failure_messages())
    if result.artifact:
        text += (f"\n\nreplay: {repro_command(Path(result.artifact), plugins)}"
                 f"\npin it into the corpus once fixed: {promote_command(result.artifact)}")
    return text


class DifftestRun:
    """The difftest side of one pytest process (single, controller or worker)."""

    def __init__(self, config: pytest.Config, role: str, shard: Shard | None,
                 gpu_env: dict[str, str], profile: str | None) -> None:
        self.config = config
        self.profile = profile
        self.role = role
        self.shard = shard
        self.store = ArtifactStore(option(config, "--difftest-artifacts"))
        self.report: dict[str, Any] | None = None
        self.earlier_crashes: list[CaseRecord] = []
        self.missing: list[str] = []  # asked-for backends that could not run
        self._session: Session | None = None
        self._capabilities: Capabilities | None = None
        self.generation: list[tuple[str, str]] = []  # (writer, line) of every process
        self._item: pytest.Item | None = None
        self._item_results: list[CaseResult] = []
        self.search_budget = search_budget(config, profile)
        self._search_started: float | None = None  # the item's first generated example
        self._item_examples = 0  # generated examples the item ran
        self._item_failure: str | None = None  # the item's first new failure
        self._expectations: list[Expectation] | None = None
        self._artifacts_in_use: set[str] = set()  # failure directories earlier tests reported
        if role == "worker":
            workerinput = config.workerinput  # type: ignore[attr-defined]
            self.writer = workerinput["workerid"]
            self.slot: int | None = workerinput["difftest_slot"]
            self.run_dir = Path(workerinput["difftest_run_dir"])
        else:
            self.slot = None
            self.writer = "main" if role == "single" else "controller"
            self.run_dir = (self.store.root / "runs" / uuid.uuid4().hex[:12]).resolve()
        self.log = RunLog(self.run_dir, self.writer)
        if role == "controller":
            config.pluginmanager.register(XdistController(self), "difftest-xdist")
        elif role == "worker":
            self.log.write("worker", pid=os.getpid(), host=platform.node(), slot=self.slot,
                           gpu_env=gpu_env,
                           visibility=pinning.runner_mask(),
                           device=devices.resolve(option(config, "--difftest-device")))

    # ----- running cases --------------------------------------------------------------
    def session(self) -> Session:
        """This process's session, created on first use and logged."""
        if self._session is None:
            if self.role == "worker":
                devices.share_cpu_threads(int(self.config.workerinput["workercount"]))  # type: ignore[attr-defined]
            names = self.config.getoption("--difftest-backends")
            self._session = Session.create(
                backend_names=None if names is None else split_names(names),
                plugins=option(self.config, "--difftest-plugin"),
                device=option(self.config, "--difftest-device"),
                artifacts=option(self.config, "--difftest-artifacts"),
                reference=option(self.config, "--difftest-reference"),
            )
            self.log.write("session", fingerprint=self._session.environment,
                           backends=self._session.backend_entries(),
                           config=self._session.config())
        return self._session

    def capabilities(self) -> Capabilities:
        """What the configured backends run (probed once per process)."""
        if self._capabilities is None:
            session = self.session()
            self._capabilities = Capabilities.probe(session.backends, session.device)
        return self._capabilities

    def case_strategy(self) -> SearchStrategy[Case]:
        """Generated examples that every configured backend runs, each in the variant fitted
        to it (:meth:`check_example`)."""
        return self.capabilities().strategy()

    def _outside_shard(self, cases: list[Case]) -> None:
        """Reject the example (or skip the test) when none of ``cases`` is in this shard."""
        if self.shard is None or any(self.shard.contains(c) for c in cases):
            return
        if hypothesis.currently_in_test_context():
            hypothesis.reject()
        where = ", ".join(f"{c.case_id} in shard {shard_of(c.case_id, self.shard.count) + 1}"
                          f"/{self.shard.count}" for c in cases)
        pytest.skip(f"case {where}, not {self.shard}")

    def check(self, case: Case, backends: tuple[str, ...] | None = None) -> CaseResult:
        """Run ``case`` (if in this shard) on ``backends`` (default: every configured one),
        log it, and fail the test if any backend failed."""
        self._outside_shard([case])
        return self._run(case, backends)

    def check_example(self, case: Case, backends: tuple[str, ...] | None = None
                      ) -> list[CaseResult]:
        """Run a generated example: every backend runs the drawn case or the variant fitted
        to it (:meth:`difftest.generation.capabilities.Capabilities.fit`), or only
        ``backends`` run the drawn case (drawn over what they run); the runs in this shard
        only; fail the test on the first run where a backend failed. Past the search budget,
        stop the test with :class:`SearchBudgetSpent` instead."""
        now = time.monotonic()
        if self._search_started is None:
            self._search_started = now
        elif self.search_budget is not None and now - self._search_started > self.search_budget:
            raise SearchBudgetSpent(self._item_examples, self.search_budget,
                                    self._item_failure)
        self._item_examples += 1
        runs = ([(f.case, f.backends) for f in self.capabilities().fit(case)]
                if backends is None else [(case, backends)])
        self._outside_shard([run_case for run_case, _ in runs])
        return [self._run(run_case, names) for run_case, names in runs
                if self.shard is None or self.shard.contains(run_case)]

    def _run(self, case: Case, backends: tuple[str, ...] | None) -> CaseResult:
        """Run ``case`` on ``backends`` (all when ``None``), log it, fail on a failure."""
        session = self.session()
        try:
            result = session.run(case, backends)
        except BaseException as exc:  # Ctrl-C or a timeout mid-case: it neither finished
            # nor crashed a backend, so no later run may blame one; the report says so
            self.log.write("interrupted", by=_stopped_by(exc), in_flight=[
                {"case_id": case_id, "running": running}
                for case_id, running in session.store.abandon()])
            raise
        nodeid = self._item.nodeid if self._item is not None else None
        self.log.write("case", record=session.records[-1].in_pytest(self.writer, nodeid).to_dict())
        if self._item is not None:
            self._item.user_properties.append(case_property(result))
        self._item_results.append(result)
        if session.records[-1].new_failures:  # a result known bugs explain wholly passes
            text = failure_text(result, session.plugins)
            self._item_failure = self._item_failure or text
            pytest.fail(text, pytrace=False)
        return result

    def expectations(self) -> list[Expectation]:
        """The known kernel bugs (:mod:`difftest.judgement.expectations`), read once, for the
        closing summary's expected bugs not seen (each result's own verdict is judged when
        it runs)."""
        if self._expectations is None:
            self._expectations = load_expectations()
        return self._expectations

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        """Know which test runs, to attach case properties and Hypothesis hints to it."""
        self._item, self._item_results = item, []
        self._search_started, self._item_examples, self._item_failure = None, 0, None
        try:
            return (yield)
        finally:
            self._item = None
            self._artifacts_in_use.update(r.artifact for r in self._item_results if r.artifact)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """End a search stopped at its budget: a pass with the examples it ran, or, when it
        had found a failure (and was shrinking it), that failure."""
        try:
            return (yield)
        except SearchBudgetSpent as spent:
            item.user_properties.append((BUDGET_PROPERTY, str(spent)))
            if spent.failure is not None:
                pytest.fail(f"{spent.failure}\n\n{spent}", pytrace=False)
            return None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Show Hypothesis's notes on a failed check, and keep them next to the failing case.

        ``check_case`` fails with ``pytrace=False``, whose report shows the message alone; the
        falsifying example and the ``@reproduce_failure`` blob Hypothesis attaches as exception
        notes would be lost, so they are added as a report section.
        """
        report = yield
        if not (report.failed and report.when == "call" and call.excinfo is not None):
            return report
        notes = [str(n) for n in getattr(call.excinfo.value, "__notes__", []) if str(n).strip()]
        if notes and notes[-1] not in report.longreprtext:
            report.sections.append(("Hypothesis", "\n".join(notes)))
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            self._discard_shrink_steps(item.nodeid)
        artifacts = [r.artifact for r in self._item_results if r.artifact]
        if artifacts:
            hints = _REPRODUCE_FAILURE.findall("\n".join([report.longreprtext, *notes]))
            text = "\n".join([f"pytest test: {item.nodeid}", *notes, *hints]) + "\n"
            Path(artifacts[-1], "pytest.txt").write_text(text)
        return report

    def _discard_shrink_steps(self, nodeid: str) -> None:
        """Keep a failed Hypothesis test's first failing and final (minimal) cases only.

        The cases Hypothesis tried while shrinking are not part of the run's case set: they
        depend on the failure, so a baseline and a candidate would not share them. They are
        dropped from the report and their failure directories removed.
        """
        results = self._item_results
        first = next((i for i, r in enumerate(results) if r.failed), None)
        if first is None:
            return
        kept = {results[first].case.case_id, results[-1].case.case_id}
        steps = {r.case.case_id: r.artifact for r in results[first + 1:-1]
                 if r.case.case_id not in kept}
        if not steps:
            return
        self.log.write("discard", nodeid=nodeid, case_ids=sorted(steps))
        for artifact in steps.values():
            if artifact and artifact not in self._artifacts_in_use:
                shutil.rmtree(artifact, ignore_errors=True)
        self._item_results = [r for r in results if r.case.case_id not in steps]

    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        """Deselect parametrized tests whose cases are outside ``--difftest-shard``."""
        if self.shard is None:
            return
        kept, dropped = [], []
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            cases = [v for v in params.values() if isinstance(v, Case)]
            (kept if all(self.shard.contains(c) for c in cases) else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    # ----- the run's report -----------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Report cases that an earlier, dead process left pending."""
        if self.role != "worker":
            self.earlier_crashes = self.store.recover_crashes(
                "found at the start of a later pytest run; the process that ran it died")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Log what generation fitted or left out; join the run logs into the report
        (controller or single process)."""
        if self._capabilities is not None and self._capabilities.examples:
            self.log.write("generation", lines=self._capabilities.lines())
        if self._session is not None:
            self.log.write("compiles", stages=self._session.compiles.to_dict())
        if self.role == "worker":
            return
        lines = RunLog.read(self.run_dir)
        self.generation = [(line["writer"], text) for line in lines
                           if line["kind"] == "generation" for text in line["lines"]]
        shutil.rmtree(self.run_dir, ignore_errors=True)
        path = self.config.getoption("--difftest-report")
        self.missing = self._unavailable_asked(lines)
        if (self.earlier_crashes or self.missing) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a crash found is a failure
        if not (path or self.earlier_crashes or self.missing
                or any(line["kind"] == "case" for line in lines)):
            return
        profile = self.profile or settings.get_current_profile_name()
        self.report = assemble_report(lines, {
            "runner": "pytest", "shard": str(self.shard) if self.shard else None,
            "hypothesis_profile": profile}, xdist=self.role == "controller",
            earlier_crashes=self.earlier_crashes).to_dict()
        if path:
            write_report(path, self.report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Searches stopped at their budget; agreement matrix, cases per backend, worst cases,
        failures and crashes."""
        for outcome in ("passed", "failed"):
            for report in terminalreporter.stats.get(outcome, []):
                for name, text in getattr(report, "user_properties", ()):
                    if name == BUDGET_PROPERTY and report.when == "call":
                        terminalreporter.write_line(f"SEARCH STOPPED: {report.nodeid}: {text}")
        if self.report is None:
            return
        terminalreporter.write_sep("=", "difftest")
        workers = self.report.get("workers", {})
        for worker, entry in workers.items():
            terminalreporter.write_line(f"worker {worker} (pid {entry['pid']}): "
                                        f"{pinning.describe(entry['gpu_env'])}, "
                                        f"{entry['cases']} cases")
        if len(workers) > 1 and (note := uncompiled_note(len(workers), "pytest workers")):
            terminalreporter.write_line(note)
        path = self.config.getoption("--difftest-report")
        for writer, line in self.generation:
            terminalreporter.write_line(f"generation ({writer}): {line}")
        for line in blind_spot_lines(self.report["config"].get("audit"), path,
                                     "--difftest-report PATH, then difftest audit PATH"):
            terminalreporter.write_line(line)
        if self.report["config"].get("kernel_compiles") is not None:
            terminalreporter.write_line(describe(self.report["config"]["kernel_compiles"],
                                                 kernel_cache_dir()))
        terminalreporter.write_line(summary(self.report, coverage=False))
        judgement = judge(case_records(self.report), self.expectations())
        for line in judgement.lines():
            terminalreporter.write_line(line)
        for line in self.missing:
            terminalreporter.write_line(f"FAILED: {line}")
        terminalreporter.write_line(verdict_line(self.report, path, judgement, self.missing))

    def _unavailable_asked(self, lines: list[dict[str, Any]]) -> list[str]:
        """A line per backend of ``--difftest-backends`` (not ``--difftest-optional``) that
        could not run in a process of this session (its logged entries), or, when difftest
        cases ran, that ran none of them: a session that tested nothing of what was asked for
        is not a pass."""
        names = self.config.getoption("--difftest-backends")
        if not names:
            return []
        entries: dict[str, Any] = {}
        for line in lines:
            if line["kind"] == "session":
                for name, entry in line["backends"].items():
                    if not entry["available"] or name not in entries:
                        entries[name] = entry
        records = [CaseRecord.from_dict(line["record"], "run log record")
                   for line in lines if line["kind"] == "case"]
        if not records:  # no difftest case ran (other tests selected): only availability
            entries = {n: e for n, e in entries.items() if not e["available"]}
        optional = split_names(self.config.getoption("--difftest-optional") or "")
        return unavailable_asked(entries, split_names(names), optional, records,
                                 option(self.config, "--difftest-reference"))

def _tested(backends: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """A report's backends under test (every backend but the reference)."""
    return [name for name in backends if name != config.get("reference")]


def _stopped_by(exc: BaseException) -> str:
    """``SIGINT``, ``SIGTERM`` or ``SIGHUP`` for an interrupt (:func:`_stop_on_sigterm`),
    else the name of what stopped the case (a timeout plug-in's exception)."""
    if isinstance(exc, KeyboardInterrupt):
        return next((name for name in ("SIGTERM", "SIGHUP") if name in str(exc)), "SIGINT")
    return type(exc).__name__


def assemble_report(lines: list[dict[str, Any]], config_extra: dict[str, Any],
                    xdist: bool, earlier_crashes: list[CaseRecord] | None = None) -> Report:
    """The report of a pytest run from its processes' run-log lines, its audit included."""
    sessions = sorted((line for line in lines if line["kind"] == "session"),
                      key=lambda line: line["writer"])
    discarded = {(line["nodeid"], case_id) for line in lines if line["kind"] == "discard"
                 for case_id in line["case_ids"]}
    records = [r for r in (CaseRecord.from_dict(line["record"], "run log record")
                           for line in lines if line["kind"] == "case")
               if (r.pytest and r.pytest.nodeid, r.case_id) not in discarded]
    backends: dict[str, dict[str, Any]] = {}
    for line in sessions:
        for name, entry in line["backends"].items():
            backends.setdefault(name, entry)
    config = (sessions[0]["config"] if sessions else {}) | config_extra
    compiles = [line["stages"] for line in lines if line["kind"] == "compiles"]
    if compiles:  # every process's, added up
        config["kernel_compiles"] = merged_compiles(compiles)
    stopped = [line for line in lines if line["kind"] == "interrupted"]
    if stopped:  # a partial report: the cases in flight neither finished nor crashed
        config["interrupted"] = {
            "signal": stopped[0]["by"],
            "in_flight": [case for line in stopped for case in line["in_flight"]]}
    workers = None
    if xdist:
        workers = {}
        for line in lines:
            if line["kind"] == "worker":
                workers[line["writer"]] = {
                    **{k: line[k] for k in ("pid", "host", "slot", "gpu_env", "visibility",
                                            "device")},
                    **dict.fromkeys(WORKER_GPU_FIELDS), "cases": 0}
        for line in sessions:
            if line["writer"] in workers:
                workers[line["writer"]].update(
                    {k: line["fingerprint"].get(k) for k in WORKER_GPU_FIELDS})
        for record in records:
            if record.pytest and record.pytest.worker in workers:
                workers[record.pytest.worker]["cases"] += 1
    environment = sessions[0]["fingerprint"] if sessions else fingerprint()
    records = unique_cases(records)
    return Report(environment, config, backends, records,
                  audit_json(records, _tested(backends, config)), workers,
                  list(earlier_crashes or []))


class XdistController:
    """The controller's xdist hooks: GPU assignment, crash recovery of dead workers."""

    def __init__(self, run: DifftestRun) -> None:
        self.run = run
        self.plan: list[dict[str, str]] = []
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []
        self.crashes: dict[str, list[CaseRecord]] = {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: list[Any]) -> None:
        """One GPU assignment per worker, from driver files and the runner's mask."""
        vendor, physical = pinning.detect()
        mask = pinning.runner_mask()
        device = option(config, "--difftest-device")
        try:
            self.plan = [pinning.assign(i, len(specs), mask, physical, vendor, device)
                         for i in range(len(specs))]
        except pinning.PinningError as exc:
            raise pytest.UsageError(f"difftest GPU pinning: {exc}") from exc

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Send a worker (or the replacement of a crashed one) its GPU and the run log."""
        worker = node.workerinput["workerid"]
        index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
        slot = index if index < len(self.plan) else (
            self.free_slots.pop(0) if self.free_slots else index % max(len(self.plan), 1))
        self.slots[worker] = slot
        node.workerinput["difftest_slot"] = slot
        node.workerinput["difftest_gpu_env"] = self.plan[slot] if self.plan else {}
        node.workerinput["difftest_run_dir"] = str(self.run.run_dir)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        """A worker died: turn the case it left pending into a crash artifact."""
        if error is None:
            return
        worker = node.workerinput["workerid"]
        if worker in self.slots:
            self.free_slots.append(self.slots[worker])
        pids = {line["pid"] for line in RunLog.read(self.run.run_dir)
                if line["kind"] == "worker" and line["writer"] == worker}
        records = self.run.store.recover_crashes(
            f"xdist worker {worker} died ({str(error).strip() or 'no message'})", pids=pids)
        for record in records:
            self.run.log.write("case", record=record.in_pytest(worker, None).to_dict())
        self.crashes[worker] = records

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport,
                               sched: Any) -> None:
        """Add the crashed case and its replay command to the test's failure."""
        worker = report.node.workerinput["workerid"]  # type: ignore[attr-defined]
        lines = [f"CRASH case {r.case_id}: replay with "
                 f"{repro_command(r.artifact or '-', r.plugins or ())}\n"
                 + "\n".join(f"  {x.backend}: {x.detail}" for x in r.results)
                 for r in self.crashes.get(worker, [])]
        if lines:
            report.longrepr = f"{report.longrepr}\n" + "\n".join(lines)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Cases still pending from any worker of this run are crashes too."""
        pids = {line["pid"] for line in RunLog.read(self.run.run_dir)
                if line["kind"] == "worker"}
        for record in self.run.store.recover_crashes("an xdist worker of this run died",
                                                     pids=pids):
            self.run.log.write("case", record=record.in_pytest(None, None).to_dict())
