import numpy as np
import pytest

from evalfleet.errors import RequestError
from evalfleet.seeds import SeedLedger, ledger


def test_seed_depends_only_on_base_and_index():
    a = SeedLedger(7).seeds(range(1000))
    b = SeedLedger(7).seeds(range(1000))
    assert np.array_equal(a, b)
    assert ledger(7, 123) == int(a[123])
    # order of the request does not matter: index 500 alone gets the same seed
    assert SeedLedger(7).seed(500) == int(a[500])


def test_no_duplicate_seeds_within_or_across_neighbouring_bases():
    seeds = np.concatenate([SeedLedger(b).seeds(range(50_000)) for b in (0, 1, 2)])
    assert len(np.unique(seeds)) == len(seeds)


def test_seeds_are_valid_gymnasium_seeds():
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    for s in SeedLedger(0).seeds(range(5)):
        env.reset(seed=int(s))


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_bad_base_seed_is_refused(bad):
    with pytest.raises(RequestError, match="'seed' must be an integer"):
        SeedLedger(bad)


# ---------------------------------------------------------------------------------------------
# Known-answer vectors
# ---------------------------------------------------------------------------------------------

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64_stream(state: int, count: int) -> list[int]:
    """Reference splitmix64 (Vigna's splitmix64.c) over Python ints: state += gamma, then mix."""
    out = []
    for _ in range(count):
        state = (state + _GAMMA) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


# The first outputs of splitmix64 from state 0, as published with the reference implementation
# (and used to seed xoshiro256** from 0).
SPLITMIX64_FROM_ZERO = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]


def test_reference_splitmix64_reproduces_the_published_outputs():
    assert _splitmix64_stream(0, 4) == SPLITMIX64_FROM_ZERO


def test_ledger_mix_is_one_splitmix64_step_from_state_x():
    # ledger(seed, i) = one splitmix64 output from state x = (seed << 32) | i, so the states
    # 0, gamma, 2 gamma, 3 gamma give the published stream.
    from evalfleet.seeds import _splitmix64

    states = np.array([(k * _GAMMA) & _MASK for k in range(4)], dtype=np.uint64)
    with np.errstate(over="ignore"):
        got = [int(v) for v in _splitmix64(states)]
    assert got == SPLITMIX64_FROM_ZERO
    assert ledger(0, 0) == SPLITMIX64_FROM_ZERO[0]  # state 0 is (seed 0, index 0)


@pytest.mark.parametrize(
    ("base_seed", "index", "expected"),
    [
        (0, 0, 0xE220A8397B1DCDAF),
        (0, 1, 0x910A2DEC89025CC1),
        (1, 0, 0xC42C5A1AA3820138),
        (7, 123, 0xCD61D1CBCA34C307),
        (42, 1000, 0x79B67585A681C4BB),
        (2**31 - 1, 2**32 - 1, 0x2A67D7552E039EA7),  # largest base seed and index
    ],
)
def test_ledger_known_answers(base_seed, index, expected):
    assert ledger(base_seed, index) == expected
    assert _splitmix64_stream((base_seed << 32) | index, 1) == [expected]


def test_vectorised_ledger_matches_the_reference_over_a_range():
    indices = list(range(0, 5000, 7)) + [2**32 - 1]
    got = [int(s) for s in SeedLedger(12345).seeds(indices)]
    assert got == [_splitmix64_stream((12345 << 32) | i, 1)[0] for i in indices]
