"""The two tiers of the CPU suite: `make test` (minutes on a 2-core machine) and `make test-all`.

`make test` must stay under 10 minutes, cold, on a 2-core machine 3x slower than the one it
was measured on (installs included). On a slow one (2 EPYC Zen 1 cores, 2026-12-05) the
installs take ~1 min 15 s, so its tests get ~2 minutes there. It runs the
unit tests: neither the `launch` tests (process groups), nor the Triton interpreter's
(tests/interpret), nor what is marked slow; `make test-all` (CI) runs everything.

  slow   a test that only `make test-all` (and `make test-gpu`) runs: launches of more than
         two ranks, torchrun launches, the harness's own stuck-rank checks, all but one of
         Inductor's C++ compile cases (test_compile.py keeps the one that takes every branch),
         all but one compiled HF model (test_hf_llama_compile.py keeps convert's default,
         fullgraph; Dynamo's tracing takes 15-60 s a case there),
         and every test that needs the C++ extension built (the `ext` and `built` fixtures,
         marked here; ~45 s of build on two cores).
  sweep  a parametrized test whose combinations are a sweep. `make test` runs a pairwise
         cover of them: every pair of values of any two parameters appears in at least one
         test that runs (and every single value, for a parameter alone). The other
         combinations are marked slow. The cover is computed from the collected items alone,
         the same on every xdist worker.
"""
from __future__ import annotations

import collections
import itertools
from typing import Dict, List, Tuple

import pytest


def pairwise_cover(combos: List[Tuple[int, ...]]) -> List[int]:
    """Indices into `combos` (tuples of parameter value indices, one per parameter) whose
    combinations cover every (parameter, value, parameter, value) pair that any combination
    has, chosen greedily (most new pairs first, the earliest on ties)."""
    def pairs(c):
        if len(c) == 1:
            return {(0, c[0])}
        return {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}

    todo = set().union(*(pairs(c) for c in combos)) if combos else set()
    chosen = []
    while todo:
        best = max(range(len(combos)), key=lambda k: (len(pairs(combos[k]) & todo), -k))
        chosen.append(best)
        todo -= pairs(combos[best])
    return chosen


def _key(value):
    """A parameter value as a dict key (callspec.indices do not number a parameter's values)."""
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):

    sweeps: Dict[tuple, list] = collections.defaultdict(list)
    for item in items:
        if {"ext", "built"} & set(getattr(item, "fixturenames", ())):  # needs the C++ extension built
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("sweep") is not None and hasattr(item, "callspec"):
            # GPU items apart: make test's CPU run must cover every pair among the CPU items
            gpu = item.get_closest_marker("gpu") is not None
            sweeps[(item.path, item.cls, item.originalname, gpu)].append(item)
    for group in sweeps.values():
        names = sorted(group[0].callspec.params)
        values: Dict[str, dict] = {n: {} for n in names}  # per parameter: value -> its index
        combos = [tuple(values[n].setdefault(_key(item.callspec.params[n]), len(values[n])) for n in names)
                  for item in group]
        keep = set(pairwise_cover(combos))
        for k, item in enumerate(group):
            if k not in keep:
                item.add_marker(pytest.mark.slow)

