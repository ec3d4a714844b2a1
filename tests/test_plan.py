"""The plan of ``difftest run``: its cases by origin, the same counts in every shard."""

from __future__ import annotations

import torch

from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.generation.capabilities import Capabilities
from difftest.generation.corpus import load_corpus
from difftest.generation.generate import generated_cases
from difftest.run.plan import RunPlan, case_set_line
from difftest.run.shard import Shard


def test_the_plan_counts_its_cases_by_origin_in_every_shard() -> None:
    """Corpus cases run on every backend, generated ones as drawn, fitted ones (named
    ``... fitted: ...``) on the backends that refused the drawn case; a shard keeps its own
    runs and records the whole set's counts."""
    capabilities = Capabilities.probe([TritonUnifiedAttention()], torch.device("cpu"))
    examples = generated_cases(8, 0, capabilities.strategy)
    corpus = load_corpus()[:2]
    plan = RunPlan.build(capabilities, corpus, examples)
    counts = plan.counts()
    assert counts["corpus"] == 2 and sum(counts.values()) == len(plan.runs)
    assert counts["generated"] + counts["fitted"] == len(plan.runs) - 2 >= 8 - 1
    for run in plan.runs:
        assert (run.backends is None) == (run.origin == "corpus")
        assert ("fitted:" in (run.case.name or "")) == (run.origin == "fitted")
    shard = Shard(1, 2)
    sharded = RunPlan.build(capabilities, corpus, examples, shard)
    assert sharded.counts() == counts
    assert [r.case.case_id for r in sharded.runs] == [
        r.case.case_id for r in plan.runs if shard.contains(r.case)]
    assert case_set_line(counts).startswith(
        f"{len(plan.runs)} cases: 2 corpus, {counts['generated']} generated")
    assert case_set_line(counts, "1/2", len(sharded.runs)).startswith(
        f"shard 1/2: {len(sharded.runs)} cases of a case set of {len(plan.runs)} cases")
