"""tests/tiers.py's pairwise cover: every pair of values of any two parameters that a sweep has
appears in a kept combination, and the cover is much smaller than the full product."""
import itertools

from tiers import pairwise_cover


def pairs(combo):
    return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}


def test_cover_has_every_pair_of_a_full_product():
    combos = list(itertools.product(range(2), range(5), range(3), range(3), range(4)))
    kept = pairwise_cover(combos)
    assert set().union(*(pairs(combos[k]) for k in kept)) == set().union(*(pairs(c) for c in combos))
    assert len(kept) <= 30 < len(combos)


def test_cover_of_a_filtered_product_and_of_one_parameter():
    combos = [c for c in itertools.product(range(3), range(3), range(2)) if c[0] != c[1]]
    kept = pairwise_cover(combos)
    assert set().union(*(pairs(combos[k]) for k in kept)) == set().union(*(pairs(c) for c in combos))
    assert sorted(pairwise_cover([(0,), (1,), (2,)])) == [0, 1, 2]  # one parameter: every value
    assert pairwise_cover([]) == []
