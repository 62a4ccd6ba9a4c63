"""The runner's correctness: replayable rows, no autoreset leak, no short-episode bias."""

import gymnasium as gym
import numpy as np
import pytest

import tests.flows.user_envs  # noqa: F401  registers Warehouse-v0
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import OUTCOME_COLUMNS, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger

CTX = EpisodeContext("req", "sha", "env", "spec", "w0")


def _policy(path_or_ref, env_id="CartPole-v1", kwargs=None):
    resolved = resolve_env(env_id, kwargs or {}, None)
    art = receive_policy(path_or_ref, None, resolved.observation_space, resolved.action_space)
    return load_policy(art.format, art.payload, None, art.source, resolved.action_space)


def _run(env_id, policy, n, slots, seed=0, max_steps=None):
    ledger = SeedLedger(seed)
    episodes = [(i, ledger.seed(i)) for i in range(n)]
    backend = InProcessSlots(env_thunk(env_id, {}, max_steps), slots)
    try:
        records = run_shard(episodes, backend, policy, CTX)
    finally:
        backend.close()
    return records_to_table(records).sort_by("episode_index")


def _replay(env_id, policy, seed, max_steps=None):
    env = gym.make(env_id, **({"max_episode_steps": max_steps} if max_steps else {}))
    obs, _ = env.reset(seed=seed)
    total, length, done = 0.0, 0, False
    while not done:
        action = policy.act(np.asarray(obs, dtype=np.float32)[None])[0]
        obs, reward, terminated, truncated, _ = env.step(int(action))
        total += float(reward)
        length += 1
        done = terminated or truncated
    return total, length


def test_every_row_replays_exactly(example_policy):
    policy = _policy(example_policy)
    table = _run("CartPole-v1", policy, 40, slots=16)
    assert table.num_rows == 40
    lengths = set()
    for row in table.to_pylist():
        ret, length = _replay("CartPole-v1", policy, row["seed"])
        assert (row["return"], row["length"]) == (ret, length), f"episode {row['episode_index']}"
        lengths.add(length)
    assert len(lengths) > 3, "the example policy should produce varied episode lengths"


def test_results_do_not_depend_on_slot_count(example_policy):
    policy = _policy(example_policy)
    tables = [_run("CartPole-v1", policy, 30, slots=k).select(list(OUTCOME_COLUMNS))
              for k in (1, 7, 30)]
    assert tables[0].equals(tables[1]) and tables[1].equals(tables[2])


def test_exactly_n_rows_whatever_the_lengths():
    # Few slots and episodes of very different lengths: a "first N to finish" loop would over-
    # represent short episodes; indices fixed up front give exactly one row per index.
    policy = _policy("tests.flows.user_envs:toward_goal", "tests.flows.user_envs:Warehouse-v0")
    table = _run("tests.flows.user_envs:Warehouse-v0", policy, 200, slots=3)
    assert table.column("episode_index").to_pylist() == list(range(200))
    assert len(set(table.column("length").to_pylist())) > 5


def test_returns_are_unrounded_float64_sums():
    policy = _policy("tests.flows.user_envs:toward_goal", "tests.flows.user_envs:Warehouse-v0")
    table = _run("tests.flows.user_envs:Warehouse-v0", policy, 20, slots=4)
    assert str(table.schema.field("return").type) == "double"
    for row in table.to_pylist():
        env = gym.make("tests.flows.user_envs:Warehouse-v0")
        obs, _ = env.reset(seed=row["seed"])
        total, done = 0.0, False
        while not done:
            obs, r, term, trunc, _ = env.step(int(obs[1] > obs[0]))
            total += r
            done = term or trunc
        assert row["return"] == total  # bit-for-bit, never rounded
        assert row["return"] != round(row["return"], 6) or row["length"] == 0


def test_truncation_and_success_are_recorded():
    policy = _policy("tests.flows.user_envs:toward_goal", "tests.flows.user_envs:Warehouse-v0")
    table = _run("tests.flows.user_envs:Warehouse-v0", policy, 30, slots=5, max_steps=3)
    reasons = set(table.column("end_reason").to_pylist())
    assert reasons <= {"terminated", "truncated"} and "truncated" in reasons
    assert max(table.column("length").to_pylist()) <= 3
    for row in table.to_pylist():
        assert row["success"] is (True if row["end_reason"] == "terminated" else None)


class _UnsureSuccess(gym.Env):
    """Ends at its third step with ``info["success"]``: NaN for odd seeds, else 1.0."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t, self._unsure = 0, bool(seed % 2)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self._t += 1
        done = self._t == 3
        info = {"success": float("nan") if self._unsure else 1.0} if done else {}
        return np.zeros(2, np.float32), 1.0, done, False, info


def test_a_nan_success_flag_is_no_success():
    # bool(nan) is True: an env that reports an undecided success as NaN counted as a success.
    env_id = "UnsureSuccess-v0"
    gym.register(env_id, entry_point=_UnsureSuccess, max_episode_steps=10)
    try:
        table = _run(env_id, _policy("tests.flows.user_envs:toward_goal_dawdling", env_id), 12, 4)
    finally:
        gym.registry.pop(env_id, None)
    assert [r["success"] for r in table.to_pylist()] == [
        None if r["seed"] % 2 else True for r in table.to_pylist()]
    assert None in table.column("success").to_pylist()


class _Broken(gym.Env):
    """Fails by mode: raise in step, NaN reward, both only for odd seeds."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, mode="raise"):
        self.mode = mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._bad = int(self.np_random.integers(0, 4)) == 0
        self._t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self._t += 1
        if self._bad and self._t == 3:
            if self.mode == "raise":
                raise RuntimeError("boom at step 3")
            return np.zeros(2, np.float32), float("nan"), False, False, {}
        return np.zeros(2, np.float32), 1.0, self._t >= 5, False, {}


gym.register("evalfleet-test/Broken-v0", entry_point=_Broken, max_episode_steps=10)


@pytest.mark.parametrize("mode,reason", [("raise", "env_error"), ("nan", "invalid_reward")])
def test_env_failures_are_rows_and_others_carry_on(mode, reason):
    policy = _policy(
        "tests.flows.user_envs:toward_goal", "evalfleet-test/Broken-v0", {"mode": mode}
    )
    ledger = SeedLedger(0)
    backend = InProcessSlots(env_thunk("evalfleet-test/Broken-v0", {"mode": mode}, None), 4)
    records = run_shard([(i, ledger.seed(i)) for i in range(40)], backend, policy, CTX)
    table = records_to_table(records).sort_by("episode_index").to_pylist()
    assert len(table) == 40
    failed = [r for r in table if r["end_reason"] != "terminated"]
    assert failed and all(r["end_reason"] == reason for r in failed)
    assert all(r["length"] == 5 and r["return"] == 5.0 for r in table if r not in failed)
    if mode == "raise":
        assert all("RuntimeError: boom at step 3" in r["error"] for r in failed)


def test_invalid_actions_and_policy_errors_are_rows():
    resolved = resolve_env("CartPole-v1", {}, None)
    from evalfleet.policy import LoadedPolicy

    bad_action = LoadedPolicy(lambda o: np.full(len(o), 5), resolved.action_space,
                              is_torch=False, deterministic=True, device="cpu")
    table = _run("CartPole-v1", bad_action, 6, slots=3)
    assert set(table.column("end_reason").to_pylist()) == {"invalid_action"}
    assert "action 5 not in Discrete(2)" in table.column("error")[0].as_py()

    def explode(obs):
        raise ValueError("policy exploded")

    failing = LoadedPolicy(explode, resolved.action_space, is_torch=False, deterministic=True,
                           device="cpu")
    table = _run("CartPole-v1", failing, 6, slots=3)
    assert set(table.column("end_reason").to_pylist()) == {"policy_error"}
    assert "ValueError: policy exploded" in table.column("error")[0].as_py()


def test_native_and_instance_paths_watched_or_not_give_one_table():
    # The shard's four ways through ShardRun (native vector or env instances; episodes in a
    # watched thread or in the caller) must give the same rows, bit for bit.
    from evalfleet.policy import LoadedPolicy

    resolved = resolve_env("CartPole-v1", {}, None)
    weights = np.array([0.0, 0.0, 1.0, 0.01])  # falls after 40 to 150 steps: varied lengths
    policy = LoadedPolicy(lambda o: (o @ weights > 0).astype(np.int64), resolved.action_space,
                          is_torch=False, deterministic=True, device="cpu")
    ledger = SeedLedger(7)
    episodes = [(i, ledger.seed(i)) for i in range(300)]
    tables = []
    for native in (True, False):
        for timeout in (30.0, None):
            backend = InProcessSlots(env_thunk("CartPole-v1", {}, None), 64, native_vector=native)
            try:
                records = run_shard(episodes, backend, policy, CTX, policy_timeout_s=timeout)
            finally:
                backend.close()
            tables.append(records_to_table(records).sort_by("episode_index")
                          .select(list(OUTCOME_COLUMNS)))
    assert tables[0].num_rows == 300
    assert len(set(tables[0].column("length").to_pylist())) > 10
    assert all(t.equals(tables[0]) for t in tables[1:])
