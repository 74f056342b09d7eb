"""tokpipe.data's Permutation: a bijection of range(n) from a seed, at 10**12 holding nothing per element, one
index or a table of them at a time; the orders of the epochs."""

import tracemalloc

import numpy as np
import pytest

from tokpipe.data import Permutation


def test_permutation_is_a_bijection_at_a_million_and_at_small_sizes():
    assert np.array_equal(np.sort(Permutation(10**6, 7)[np.arange(10**6)]), np.arange(10**6))
    for n in [*range(1, 18), 63, 64, 65, 1000, 4**5 + 1]:
        p = Permutation(n, n)
        assert sorted(p[np.arange(n)].tolist()) == list(range(n)), n
        assert [p[i] for i in range(n)] == p[np.arange(n)].tolist()  # an int for an int, the same image
    assert type(Permutation(5, 0)[3]) is int and Permutation(5, 0)[np.arange(5)].dtype == np.int64
    assert len(Permutation(0, 0)) == 0 and Permutation(0, 0)[np.zeros(0, np.int64)].size == 0
    for bad in (-1, 5):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a Permutation of 5"):
            Permutation(5, 0)[bad]


def test_permutation_at_10_12_holds_nothing_per_element():
    n = 10**12
    lookups = np.arange(10**6) * 999_983 + 12_345  # distinct, spread over range(n)
    tracemalloc.start()
    p = Permutation(n, 3)
    images = p[lookups]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 * lookups.nbytes  # working arrays of the million lookups, nothing of n
    assert sum(a.nbytes for a in vars(p).values() if isinstance(a, np.ndarray)) <= 64  # its round keys
    images.sort()  # (np.unique of a million int64 takes 3.5 s with numpy 2.4 here; a sort 0.06 s)
    assert images[0] >= 0 and images[-1] < n and np.all(np.diff(images) > 0)


def test_one_index_at_a_time_gives_the_arrays_image_as_an_int():
    # Its speed (~4 us a lookup against numpy's ~135 us) is benchmarks/loader.py's to measure, not a test's.
    p = Permutation(10**12 + 39, 5)  # 2**40 > n: about 1.1 passes a lookup
    indices = list(range(7, 10**12, 10**12 // 2_000))
    images = [p[i] for i in indices]
    assert images == p[np.array(indices)].tolist() and type(images[0]) is int
    assert p[np.int64(7)] == images[0] and type(p[np.uint32(7)]) is int
    with pytest.raises(TypeError, match="Permutation indices must be integers, not bool"):
        p[True]


def test_lookups_by_tables_give_the_arithmetics_images():
    for n in (16_615, 2**24, 2**24 + 1):  # tables up to 24 bits, the arithmetic above
        p, sample = Permutation(n, 3), np.arange(0, n, n // 3_000)
        assert p[sample].tolist() == [p[i] for i in sample.tolist()], n  # an int's image is the arithmetic's


def test_orders_made_at_once_are_each_seeds_permutation():
    for n in (1, 2, 3, 5, 17, 20, 64, 65, 1000, 4096):
        seeds = list(range(-2, 30))
        expected = np.stack([Permutation(n, seed)[np.arange(n)] for seed in seeds])
        assert np.array_equal(Permutation.orders(n, seeds), expected), n


def test_different_seeds_give_unrelated_orders():
    n = 100_000
    orders = [Permutation(n, seed)[np.arange(n)] for seed in range(4)]
    for a in range(4):
        # Two unrelated permutations agree in ~1 place (Poisson); ranks correlate ~0 (sd 1/sqrt(n) = 0.003).
        assert np.count_nonzero(orders[a] == np.arange(n)) < 10
        for b in range(a + 1, 4):
            assert np.count_nonzero(orders[a] == orders[b]) < 10
            assert abs(np.corrcoef(orders[a], orders[b])[0, 1]) < 0.02
