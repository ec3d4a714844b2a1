"""The historical-bug benchmark (``benchmarks/history.py``): releases, known bugs, attribution,
fetching, and that the default strategies reach every fixed bug within 50 examples.

The reach test runs kernels of fetched releases (``scripts/fetch_vllm.sh``,
``scripts/fetch_aiter.sh``) and skips, naming the command, where one is missing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.history import (
    KNOWN_BUGS,
    attribute,
    example_label,
    known_bugs,
    release_of,
    release_parts,
    release_version,
    run_cases,
)
from difftest.backends.aiter_release import AiterFetchError, fetch_missing
from difftest.backends.aiter_triton import SourceError
from difftest.backends.aiter_triton import resolve as resolve_aiter
from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_release import ReleaseError
from difftest.case.spec import Case
from difftest.contract.registry import RegistryError, discover, select
from difftest.generation.dense import dense_cases
from difftest.generation.generate import generated_cases
from difftest.run.runner import Status, run_case

BUG = {b.name: b for b in KNOWN_BUGS}
FIXED_BUGS = [b for b in KNOWN_BUGS if b.fixed]
# a dense case of 48-token pages: the first stratum of the covering schedule
PAGE_48 = generated_cases(1, 0, dense_cases)[0]
MODES = Case(num_blocks=128, seq_lens=(128,), block_tables=((0,),), selections=((0,),),
             num_q_heads=1, softcap=0.01, sliding_window=1, canary=True, split_k_segments=2,
             seq_threshold_3d=1)


def test_releases_compare_as_versions_tags_and_post_releases_included() -> None:
    assert release_version("v0.1.16.post3") > release_version("0.1.16")
    assert release_version("0.1.7.post2.dev18") < release_version("v0.1.12")
    fp16 = BUG["aiter-fp16-3d-assert"]  # since v0.1.16: older releases lack it
    assert [fp16.present_in(f"aiter-unified@{v}") for v in
            ("0.1.7.post2.dev18", "0.1.11", "0.1.16", "0.1.16.post2", "0.1.16.post3")] == [
        False, False, True, True, False]
    page = BUG["aiter-page-48"]
    assert page.present_in("aiter-unified@0.1.7.post2.dev18")
    assert not page.present_in("aiter-unified@0.1.12")
    assert not page.present_in("triton-unified@0.1.11")  # another backend's release
    assert BUG["softcap-nan"].present_in("triton-unified@0.30.0")
    assert not BUG["softcap-nan"].present_in("triton-unified@0.31.0")


def test_an_error_bug_is_shown_by_its_error_on_a_case_that_triggers_it() -> None:
    page = BUG["aiter-page-48"]
    assert PAGE_48.page_size == 48 and not PAGE_48.query_lens
    error = "InterpreterError: ValueError(\"arange's range must be a power of 2\")"
    assert page.raised_by("aiter-unified@0.1.11", PAGE_48, "error", error)
    assert not page.raised_by("aiter-unified@0.1.12", PAGE_48, "error", error)
    assert not page.raised_by("aiter-unified@0.1.11", PAGE_48, "error", "other error")
    assert not page.raised_by("aiter-unified@0.1.11", PAGE_48, "disagree", error)
    sixteen = PAGE_48.replace(kv_layout="LBHNC", page_size=16)
    assert not page.raised_by("aiter-unified@0.1.11", sixteen, "error", error)
    assert page.release_name(page.buggy) == "aiter-unified[aiter=v0.1.11]"
    assert page.control == "" and BUG["softcap-nan"].control == "triton-unified"


def test_ablation_tries_the_known_bugs_modes_first() -> None:
    """A failure the softcap explains on an AITER release is shown as F21 by switching off
    the modes of its known bugs; split-K (no known bug's mode there) is not run."""
    ran: list[tuple[str, ...]] = []

    def softcap_fails(case: Case) -> str:
        ran.append(case.kernel_modes)
        return "disagree" if case.softcap else "agree"

    attribution = attribute(MODES, "aiter-unified@0.1.11", softcap_fails)
    assert attribution.bugs == ["aiter-softcap-nan"]
    assert set(attribution.statuses) == {"softcap", "sliding_window", "canary"}
    assert all("split_k_segments" in modes for modes in ran)
    # where no known bug is shown, every other mode is ablated too
    ran.clear()
    unexplained = attribute(MODES, "aiter-unified@0.1.11", lambda case: "disagree")
    assert "split_k_segments" in unexplained.statuses and not unexplained.shown()


def test_window_and_canaries_both_needed_show_the_window_bug() -> None:
    """On an AITER release a failure that agrees with the window off and with the canaries
    off is the window NaN (F22), which needs both, not the tail NaN (F24), which needs only
    canaries; where the window is not needed it is the tail NaN."""
    case = MODES.replace(softcap=0.0, split_k_segments=0, seq_threshold_3d=0)
    both = attribute(case, "aiter-unified@0.1.16.post3",
                     lambda c: "disagree" if c.sliding_window and c.canary else "agree")
    assert both.explanation == ["sliding_window", "canary"]
    assert both.bugs == ["aiter-window-nan"]
    canary = attribute(case, "aiter-unified@0.1.16.post3",
                       lambda c: "disagree" if c.canary else "agree")
    assert canary.bugs == ["aiter-tail-nan"]


def test_example_labels_and_aiter_options() -> None:
    assert example_label(12, 50) == "12" and example_label(54, 50) == "54 (dense 4)"
    assert release_parts("aiter-unified[aiter=v0.1.11]") == ("aiter-unified", "v0.1.11")


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                        "HOME": str(cwd), "PATH": "/usr/bin:/bin"})


def test_a_missing_aiter_tag_is_fetched_or_the_command_named(tmp_path: Path,
                                                             monkeypatch) -> None:
    """A bump fetches a tag it names as ``scripts/fetch_aiter.sh`` does, from a repository URL
    as on a clean machine (a shallow fetch of the tag); a tag that cannot be fetched stops it
    with the command to run elsewhere."""
    repo = tmp_path / "repo"
    (repo / "aiter" / "ops" / "triton").mkdir(parents=True)
    (repo / "aiter" / "ops" / "triton" / "kernel.py").write_text("X = 1\n")
    _git("init", "-q", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("commit", "-q", "-m", "tree", cwd=repo)
    _git("tag", "v9.9.9", cwd=repo)
    monkeypatch.setenv("DIFFTEST_AITER_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("DIFFTEST_AITER_REPO", f"file://{repo}")
    with pytest.raises(SourceError):
        resolve_aiter("v9.9.9")
    assert fetch_missing(["v9.9.9", "/some/path"]) == ["v9.9.9"]
    assert resolve_aiter("v9.9.9").version == "9.9.9"
    assert fetch_missing(["v9.9.9"]) == []  # there already
    with pytest.raises(AiterFetchError, match=r"aiter=v9\.9\.8: fetching tag v9\.9\.8 of .* "
                       r"failed .*bash scripts/fetch_aiter\.sh v9\.9\.8 .*DIFFTEST_AITER_REPO"):
        fetch_missing(["v9.9.8"])
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["v9.9.9"]


def _release(bug: object, release: str) -> object:
    """The backend running ``release`` of ``bug``, skipped where it is not fetched."""
    try:
        (found,) = select(discover(), [bug.release_name(release)])
    except (ReleaseError, RegistryError, SourceError) as err:
        pytest.skip(str(err))
    if not found.availability().available:
        pytest.skip(f"{found.availability().reason} (bash scripts/fetch_{bug.option}.sh "
                    f"{release})")
    return found


@pytest.mark.parametrize("bug", FIXED_BUGS, ids=[b.name for b in FIXED_BUGS])
def test_the_default_strategies_reach_each_historical_bug_within_50_examples(
        bug, device_name) -> None:
    """The cases ``difftest run --backends <buggy> --examples 50`` runs on the buggy release
    (50 sparse and 10 dense examples, and the variants its older releases run) hold one that
    triggers this bug; on the first that only it explains, the buggy
    release fails as the bug does, and the fixed release and the control agree unless a
    known bug of their own explains the case."""
    device = torch.device(device_name)
    buggy, fixed = _release(bug, bug.buggy), _release(bug, bug.fixed)
    others = [fixed] + ([select(discover(), [bug.control])[0]] if bug.control else [])
    drawn = run_cases(buggy, device, 50, 0)
    release = release_of(buggy)
    runnable = [c for c in drawn if bug.name in known_bugs(release, c)
                and buggy.unsupported_reason(c, device) is None]
    assert runnable, f"no case of the {len(drawn)} needs {bug.name}"
    first = next((c for c in runnable if known_bugs(release, c) == [bug.name]), runnable[0])
    result = run_case(first, TorchReference(), [buggy, *others], device, diagnose=False)
    outcome = result.results[0]
    if bug.error:
        assert outcome.status is Status.ERROR and bug.error in outcome.detail, outcome.detail
    else:
        assert outcome.status is Status.DISAGREE, outcome.detail
    for backend, other in zip(others, result.results[1:], strict=True):
        assert other.status is Status.AGREE or known_bugs(release_of(backend), first), (
            other.detail)
