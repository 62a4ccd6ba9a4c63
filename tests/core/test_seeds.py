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
