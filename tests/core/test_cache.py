"""The cache key must change with every ingredient that can change an episode, and only those."""

import hashlib
import json
import sys
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import evalfleet
import evalfleet.cache
from evalfleet.cache import EpisodeCache
from evalfleet.models import EvalRequest
from evalfleet.pipeline import Collected, episode_cache, key_held, lookup, receive, store_in_cache
from evalfleet.records import EPISODE_SCHEMA, EpisodeRecord, records_to_table


def _key(**fields):
    return receive(EvalRequest.build(**fields)).cache_key


@pytest.fixture
def base(example_policy, tmp_path):
    return dict(policy=example_policy, episodes=10, output=tmp_path)


@pytest.mark.parametrize("change", [
    {"env_kwargs": {"sutton_barto_reward": True}},
    {"max_steps": 200},
    {"seed": 1},
    {"deterministic": False},
    {"env": "CartPole-v0"},
])
def test_protocol_and_env_changes_miss(base, change):
    assert _key(**base) != _key(**{**base, **change})


def test_execution_settings_do_not_change_the_key(base):
    key = _key(**base)
    assert key == _key(**{**base, "workers": 1, "concurrency": 3, "isolation": "inprocess",
                          "request_id": "other", "training_run_id": "t", "step": 9})


def test_evalfleet_version_is_in_the_key(base, monkeypatch):
    key = _key(**base)
    monkeypatch.setattr(evalfleet, "__version__", "99.0.0")
    assert _key(**base) != key


def test_env_source_version_is_in_the_key(tmp_path, monkeypatch):
    mod = tmp_path / "keyenv_mod.py"
    src = open("tests/flows/user_envs.py").read().replace('gym.register("Warehouse-v0"',
                                                          'gym.register("KeyWarehouse-v0"')
    mod.write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    fields = dict(env="keyenv_mod:KeyWarehouse-v0", policy="tests.flows.user_envs:toward_goal",
                  output=tmp_path)
    key = _key(**fields)
    mod.write_text(src.replace("noise = float(self.np_random.random()) * 0.01",
                               "noise = float(self.np_random.random()) * 0.02"))
    assert "keyenv_mod" not in sys.modules  # an env's own module is imported in sandboxes only
    assert _key(**fields) != key


def test_two_callables_of_one_module_are_two_policies(tmp_path):
    env = "evalfleet/Inventory-v0"
    a = _key(env=env, policy="envs.reference_policies:inventory_random", output=tmp_path)
    b = _key(env=env, policy="envs.reference_policies:inventory_heuristic", output=tmp_path)
    assert a != b


def test_same_weights_elsewhere_hit_other_weights_same_name_miss(tmp_path, example_policy):
    a, b = tmp_path / "a" / "policy.pt", tmp_path / "b" / "policy.pt"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(open(example_policy, "rb").read())
    assert _key(policy=str(a), output=tmp_path) == _key(policy=str(b), output=tmp_path)
    net = torch.jit.load(str(a))
    with torch.no_grad():
        next(net.parameters()).add_(0.01)
    torch.jit.save(net, str(b))
    assert _key(policy=str(a), output=tmp_path) != _key(policy=str(b), output=tmp_path)


def _table(indices, reason="terminated", isolation="inprocess"):
    return records_to_table([
        EpisodeRecord("r", "sha", "env", "spec", i, 1000 + i, float(i) + 0.5, 10, reason, None,
                      None, 0.1, "w", "s", isolation) for i in indices])


def test_top_up_reports_what_is_missing_and_merges(tmp_path):
    cache = EpisodeCache(tmp_path)
    cache.store("k" * 64, _table(range(10)), {})
    found = cache.lookup("k" * 64, range(25))
    assert found.status == "partial" and found.missing == list(range(10, 25))
    assert found.stored.column("episode_index").to_pylist() == list(range(10))
    cache.store("k" * 64, _table(range(10, 25)), {})
    full = cache.lookup("k" * 64, range(25))
    assert full.status == "hit" and full.stored.num_rows == 25
    assert cache.lookup("k" * 64, range(5)).stored.num_rows == 5  # fewer episodes: a subset hit


def test_infrastructure_failures_are_not_stored(tmp_path):
    cache = EpisodeCache(tmp_path)
    rows = pa.concat_tables([_table([0, 1]), _table([2], "crashed"), _table([3], "timeout"),
                             _table([4], "env_error"), _table([5], "policy_error")])
    assert cache.store("a" * 64, rows, {}) == 3
    assert cache.lookup("a" * 64, range(6)).missing == [2, 3, 5]


def test_an_env_error_raised_in_a_sandbox_is_not_stored(tmp_path):
    # "PermissionError" from a file the sandbox may not open, EPERM from a refused socket: the
    # confinement's doing. Served from the cache to an inprocess request (or one that allows
    # the file), it was an env failure that run would never have had.
    cache = EpisodeCache(tmp_path)
    rows = pa.concat_tables([_table([0], isolation="process"),
                             _table([1], "env_error", isolation="process"),
                             _table([2], "env_error", isolation="bwrap"),
                             _table([3], "invalid_action", isolation="bwrap"),
                             _table([4], "env_error")])
    assert cache.store("e" * 64, rows, {}) == 3
    found = cache.lookup("e" * 64, range(5))
    assert found.missing == [1, 2]
    assert found.stored.column("end_reason").to_pylist() == [
        "terminated", "invalid_action", "env_error"]


def _entry_table(cache, key):
    """The Parquet file the entry's manifest names."""
    return cache.entry(key) / json.loads((cache.entry(key) / "manifest.json").read_text())["table"]


@pytest.mark.parametrize("damage", ["truncate", "manifest", "swap"])
def test_corrupt_entries_are_detected_removed_and_never_returned(tmp_path, damage):
    """Only under the key's lock: without it, a damaged entry is a miss and stays in place."""
    cache = EpisodeCache(tmp_path)
    key = "c" * 64
    cache.store(key, _table(range(10)), {})
    data = _entry_table(cache, key)
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-40])
    elif damage == "manifest":
        (cache.entry(key) / "manifest.json").write_text("{not json")
    else:
        other = EpisodeCache(tmp_path / "other")
        other.store(key, _table(range(3)), {})
        data.write_bytes(_entry_table(other, key).read_bytes())
    unlocked = cache.lookup(key, range(10))
    assert (unlocked.status, unlocked.stored.num_rows, unlocked.corrupt) == ("miss", 0, False)
    assert cache.entry(key).exists()
    with cache.exclusive(key):
        found = cache.lookup(key, range(10))
    assert found.corrupt and found.status == "miss" and found.stored.num_rows == 0
    assert not cache.entry(key).exists()


def test_the_check_catches_accidental_damage_not_a_consistent_forgery(tmp_path):
    """What README's "damaged by accident" promises, and the limit it states.

    A table edited in place no longer matches the sha256 its manifest names: recomputed. A
    table rewritten under its new sha256 with the manifest naming it is no damage to the check,
    and is served (returns x10): the cache trusts whoever can write its folder.
    """
    cache = EpisodeCache(tmp_path)
    key = "d" * 64
    cache.store(key, _table(range(10)), {})
    table = pq.read_table(_entry_table(cache, key))
    tenfold = table.set_column(table.schema.get_field_index("return"), "return",
                               pc.multiply(table.column("return"), 10.0))
    pq.write_table(tenfold, _entry_table(cache, key))  # in place: the sha256 no longer matches
    with cache.exclusive(key):
        found = cache.lookup(key, range(10))
    assert found.corrupt and found.status == "miss"

    cache.store(key, table, {})
    manifest_path = cache.entry(key) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    forged = cache.entry(key) / "forged.parquet"
    pq.write_table(tenfold, forged)
    sha = hashlib.sha256(forged.read_bytes()).hexdigest()
    forged.rename(cache.entry(key) / f"episodes-{sha}.parquet")
    manifest.update(table=f"episodes-{sha}.parquet", parquet_sha256=sha)
    manifest_path.write_text(json.dumps(manifest))
    with cache.exclusive(key):
        served = cache.lookup(key, range(10))
    assert (served.status, served.corrupt) == ("hit", False)
    assert served.stored.column("return").to_pylist() == [10 * (i + 0.5) for i in range(10)]


def test_lookup_without_the_lock_during_a_store_keeps_the_entry(tmp_path, monkeypatch):
    """A lookup between a top-up's table and its manifest sees the entry as it was, whole."""
    writer, reader = EpisodeCache(tmp_path), EpisodeCache(tmp_path)
    key = "f" * 64
    writer.store(key, _table(range(10)), {})
    seen = []
    real = evalfleet.cache.write_json

    def interleaved(data, path):
        if path.name == "manifest.json":  # the new table is on disk, the manifest not yet
            seen.append(reader.lookup(key, range(25)))
        return real(data, path)

    monkeypatch.setattr(evalfleet.cache, "write_json", interleaved)
    assert writer.store(key, _table(range(10, 25)), {}) == 25
    [during] = seen
    assert (during.status, during.stored.num_rows, during.corrupt) == ("partial", 10, False)
    after = reader.lookup(key, range(25))
    assert (after.status, after.stored.num_rows, after.corrupt) == ("hit", 25, False)
    assert sorted(p.name for p in writer.entry(key).iterdir()) == [
        _entry_table(writer, key).name, "manifest.json"]


def test_a_read_follows_a_manifest_switched_while_it_read(tmp_path, monkeypatch):
    """The reader has the old manifest; a store switches it and deletes the old table."""
    writer, reader = EpisodeCache(tmp_path), EpisodeCache(tmp_path)
    key = "9" * 64
    writer.store(key, _table(range(10)), {})
    real, fired = evalfleet.cache._verified, []

    def store_meanwhile(path, sha256):
        if not fired:
            fired.append(path.name)
            writer.store(key, _table(range(10, 25)), {})
        return real(path, sha256)

    monkeypatch.setattr(evalfleet.cache, "_verified", store_meanwhile, raising=False)
    found = reader.lookup(key, range(25))
    assert fired and not (writer.entry(key) / fired[0]).exists()
    assert (found.status, found.stored.num_rows, found.corrupt) == ("hit", 25, False)


def test_entries_stored_before_tables_were_named_by_sha256_are_read(tmp_path):
    cache = EpisodeCache(tmp_path)
    key = "7" * 64
    folder = cache.entry(key)
    folder.mkdir(parents=True)
    pq.write_table(_table(range(4)).cast(EPISODE_SCHEMA), folder / "episodes.parquet")
    (folder / "manifest.json").write_text(json.dumps({
        "key": key, "rows": 4, "ingredients": {},
        "parquet_sha256": hashlib.sha256((folder / "episodes.parquet").read_bytes()).hexdigest()}))
    assert cache.lookup(key, range(4)).status == "hit"
    assert cache.store(key, _table(range(4, 6)), {}) == 6
    assert not (folder / "episodes.parquet").exists()
    assert cache.lookup(key, range(6)).status == "hit"


def test_exclusive_lock_serialises_holders(tmp_path):
    cache = EpisodeCache(tmp_path)
    order = []

    def hold(name):
        with cache.exclusive("k" * 64):
            order.append(f"{name}-in")
            threading.Event().wait(0.2)
            order.append(f"{name}-out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order[0][0] == order[1][0] and order[2][0] == order[3][0]


def test_lookup_respects_cache_modes(base):
    request = EvalRequest.build(**base, cache="off")
    found = lookup(request, receive(request))
    assert found.status == "miss" and found.missing == list(range(10))


def test_shard_files_persist_atomically_and_merge_into_lookups(tmp_path):
    """Finished shards are whole files at once; a lookup reuses them; store folds them in."""
    cache = EpisodeCache(tmp_path)
    key = "d" * 64
    assert cache.persist_shard(key, _table([0, 1, 2])) == 3
    assert cache.persist_shard(key, pa.concat_tables([_table([5]), _table([6], "crashed")])) == 1
    folder = cache.entry(key) / "shards"
    (folder / ".0000000009-dead.parquet.123.tmp").write_bytes(b"PAR1 half a file")  # a killed writer
    found = cache.lookup(key, range(8))
    assert found.stored.column("episode_index").to_pylist() == [0, 1, 2, 5]
    assert (found.missing, found.resumed, found.status) == ([3, 4, 6, 7], 4, "partial")
    [listed] = cache.entries()
    assert (listed["key"], listed["rows"]) == (key, 4) and "interrupted" in listed["updated"]
    assert cache.store(key, _table([3, 4, 6, 7]), {}) == 8
    assert cache.shard_files(key) == []
    again = cache.lookup(key, range(8))
    assert (again.status, again.resumed) == ("hit", 0)


def test_unreadable_shard_file_is_dropped_and_recomputed(tmp_path):
    cache = EpisodeCache(tmp_path)
    key = "e" * 64
    cache.persist_shard(key, _table([0, 1]))
    cache.persist_shard(key, _table([2, 3]))
    first = cache.shard_files(key)[0]
    first.write_bytes(first.read_bytes()[:20])  # a disk fault after the rename
    with cache.exclusive(key):
        found = cache.lookup(key, range(4))
    assert found.missing == [0, 1] and found.resumed == 2 and found.corrupt
    assert first not in cache.shard_files(key)


def _silent_flip(data):
    """``data`` with the first single-bit flip that Parquet reads back as other returns."""
    original = pq.read_table(pa.BufferReader(data), schema=EPISODE_SCHEMA)
    for pos in range(4, len(data) - 8):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        try:
            table = pq.read_table(pa.BufferReader(bytes(flipped)), schema=EPISODE_SCHEMA)
        except (pa.ArrowException, OSError):
            continue
        if not table.column("return").equals(original.column("return")):
            return bytes(flipped)
    raise AssertionError("no flip reads back silently: the planted case needs another table")


def test_flipped_bit_in_a_shard_file_is_detected_and_its_episodes_recomputed(tmp_path):
    cache = EpisodeCache(tmp_path)
    key = "b" * 64
    cache.persist_shard(key, _table([0, 1, 2]))
    cache.persist_shard(key, _table([3, 4]))
    first = cache.shard_files(key)[0]
    first.write_bytes(_silent_flip(first.read_bytes()))
    unlocked = cache.lookup(key, range(5))
    assert (unlocked.missing, unlocked.resumed, unlocked.corrupt) == ([0, 1, 2], 2, False)
    assert first in cache.shard_files(key)  # left for the lock's holder to judge
    with cache.exclusive(key):
        found = cache.lookup(key, range(5))
    assert (found.missing, found.resumed, found.corrupt) == ([0, 1, 2], 2, True)
    assert found.stored.column("return").to_pylist() == [3.5, 4.5]
    assert first not in cache.shard_files(key)


def test_request_answered_from_shard_files_alone_leaves_an_entry(example_policy, tmp_path):
    """A re-run of a run killed after its last shard: nothing to compute, the shards are folded."""
    request = EvalRequest.build(policy=example_policy, episodes=6, output=tmp_path)
    received = receive(request)
    cache, key = episode_cache(request), received.cache_key
    assert cache.persist_shard(key, _table(range(6))) == 6
    found = lookup(request, received)
    assert (found.status, found.resumed) == ("hit", 6)
    collected = Collected(table=found.stored, fresh=EPISODE_SCHEMA.empty_table(),
                          audit_rows=EPISODE_SCHEMA.empty_table(), run_seconds=0.0, seconds=0.0,
                          plan_cached=6, plan_seconds=0.0, cache_status=found.status,
                          cache_corrupt=False, resumed=found.resumed)
    with cache.exclusive(key):
        assert store_in_cache(request, received, collected) == 6
    assert cache.shard_files(key) == [] and (cache.entry(key) / "manifest.json").exists()
    again = cache.lookup(key, range(6))
    assert (again.status, again.resumed, again.stored.num_rows) == ("hit", 0, 6)


def _returns(indices, value):
    """Rows of ``indices`` that all have return ``value`` (which run wrote them)."""
    return records_to_table([
        EpisodeRecord("r", "sha", "env", "spec", i, 1000 + i, value, 10, "terminated", None, None,
                      0.1, "w", "s", "inprocess") for i in indices])


def _answer(found):
    return dict(zip(found.stored.column("episode_index").to_pylist(),
                    found.stored.column("return").to_pylist(), strict=True))


def test_an_interrupted_refresh_never_mixes_into_the_entry(tmp_path):
    """A --refresh killed before its store leaves shard files over the entry's episodes.

    Lookups and the stores after them rank rows alike: every answer holds the same row for an
    index, the entry's where it has one, never half the refresh's and half the entry's.
    """
    cache = EpisodeCache(tmp_path)
    key = "a1" * 32
    with cache.exclusive(key):
        cache.store(key, _returns(range(10), 1.0), {})
        cache.persist_shard(key, _returns(range(5), 2.0))  # the refresh's shards, then a kill
        cache.persist_shard(key, _returns(range(8, 12), 2.0))
    answers = []
    with cache.exclusive(key):
        normal = cache.lookup(key, range(10))
        answers.append(_answer(normal))
        assert (normal.status, normal.resumed) == ("hit", 0)
        assert set(answers[0].values()) == {1.0}  # the entry the refresh did not replace, whole
    with cache.exclusive(key):
        top_up = cache.lookup(key, range(14))
        answers.append(_answer(top_up))
        assert (top_up.missing, top_up.resumed) == ([12, 13], 2)  # 10, 11: indices it lacked
        cache.store(key, _returns([12, 13], 1.0), {})
        assert cache.shard_files(key) == []
    for wanted in (10, 14):
        again = cache.lookup(key, range(wanted))
        assert (again.status, again.resumed) == ("hit", 0)
        answers.append(_answer(again))
    for answer in answers:  # one row per index, whichever request asked
        assert answer == {i: answers[-1][i] for i in answer}
    assert answers[-1] == {**{i: 1.0 for i in range(10)}, 10: 2.0, 11: 2.0, 12: 1.0, 13: 1.0}


def test_a_refresh_drops_the_distrusted_entry_before_it_runs(example_policy, tmp_path):
    """A --refresh killed part-way: the next plain run resumes from the refresh's rows alone.

    Before, the entry it distrusted stayed, and the next request for more episodes took its rows
    for the indices it held and the refresh's for the rest: mean 400 from 600 and 200, no alarm.
    """
    request = EvalRequest.build(policy=example_policy, episodes=8, output=tmp_path)
    key = receive(request).cache_key
    cache = episode_cache(request)
    with cache.exclusive(key):
        cache.store(key, _returns(range(4), 600.0), {})
        cache.persist_shard(key, _returns([4], 600.0))  # an older run's shard, from the same inputs
    refresh = request.model_copy(update={"cache": "refresh"})
    with key_held(refresh, key):
        assert cache.lookup(key, range(8)).stored.num_rows == 0  # dropped before anything ran
        cache.persist_shard(key, _returns(range(3), 200.0))  # its first shard; then it is killed
    found = lookup(request, receive(request))
    assert _answer(found) == {0: 200.0, 1: 200.0, 2: 200.0}
    assert (found.missing, found.resumed) == ([3, 4, 5, 6, 7], 3)
    with key_held(request, key):  # a plain run keeps what the key holds
        assert cache.lookup(key, range(8)).stored.num_rows == 3


def test_the_shard_file_written_last_wins_an_index(tmp_path):
    """Overlapping shard files (two killed refreshes): the newer one's rows, not the name order."""
    cache = EpisodeCache(tmp_path)
    key = "b2" * 32
    cache.persist_shard(key, _returns([2, 3, 4, 5], 2.0))
    cache.persist_shard(key, _returns([0, 1, 2, 3], 3.0))  # written later, its name sorts first
    assert cache.shard_files(key)[0].name.startswith("0000000000-")
    found = cache.lookup(key, range(6))
    assert _answer(found) == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0, 4: 2.0, 5: 2.0}
    assert found.resumed == 6
    with cache.exclusive(key):
        cache.store(key, _returns([], 1.0), {})
    assert _answer(cache.lookup(key, range(6))) == _answer(found)
