"""Bad input fails before anything is spawned, saying what was expected and what came."""

import pytest
import torch

import flows.eval as eval_module
from evalfleet.errors import EnvSpecError, PolicyError, RequestError
from evalfleet.models import EvalRequest


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if the flow gets as far as starting Prefect or a cluster."""

    def refuse(*args, **kwargs):
        raise AssertionError("a server or cluster was started for a bad request")

    monkeypatch.setattr(eval_module, "prefect_api", refuse)
    monkeypatch.setattr(eval_module, "fleet_cluster", refuse)


def _evaluate(**fields):
    return eval_module.evaluate(EvalRequest.build(**fields))


def test_unknown_env(no_spawn, example_policy):
    with pytest.raises(EnvSpecError, match=r"unknown env id 'CartPol-v9'.*'module:EnvId-v0'"):
        _evaluate(env="CartPol-v9", policy=example_policy)


def test_missing_policy_file(no_spawn, tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(PolicyError, match=r"policy file '.*nope.pt' does not exist.*TorchScript"):
        _evaluate(policy=str(missing))


def test_corrupt_policy_file(no_spawn, tmp_path, example_policy):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(open(example_policy, "rb").read()[:500])
    with pytest.raises(PolicyError, match=r"not a loadable TorchScript file"):
        _evaluate(policy=str(corrupt))


def test_output_shape_mismatch(no_spawn, tmp_path):
    path = tmp_path / "three.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3)), str(path))
    with pytest.raises(PolicyError, match=r"output has shape \(4, 3\).*expected logits of shape \(4, 2\)"):
        _evaluate(policy=str(path))


def test_nan_weights_are_refused(no_spawn, tmp_path):
    net = torch.nn.Linear(4, 2)
    with torch.no_grad():
        net.weight[0, 0] = float("nan")
    path = tmp_path / "nan.pt"
    torch.jit.save(torch.jit.script(net), str(path))
    with pytest.raises(PolicyError, match=r"non-finite weights in 'weight'"):
        _evaluate(policy=str(path))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("episodes", 0, r"'episodes' must be a positive integer \(got 0\)"),
        ("episodes", -5, r"'episodes' must be a positive integer \(got -5\)"),
        ("concurrency", 0, r"'concurrency' must be a positive integer \(got 0\)"),
        ("env_kwargs", "{not json", r"'env_kwargs' must be a JSON object \(got '\{not json'"),
        ("env_kwargs", "[1, 2]", r"'env_kwargs' must be a JSON object / dict \(got list"),
        ("isolation", "vm", r"Unknown isolation 'vm'. Choose one of inprocess, process, bwrap"),
    ],
)
def test_bad_fields(field, value, message, example_policy):
    with pytest.raises(RequestError, match=message):
        EvalRequest.build(policy=example_policy, **{field: value})


@pytest.mark.parametrize("kwargs,got", [
    ('{"sutton_barto_reward": NaN}', r"got NaN"),
    ('{"a": [1, Infinity]}', r"got Infinity"),
    ('{"a": -Infinity}', r"got -Infinity"),
    ({"a": {"b": [float("nan")]}}, r"got nan at \['a'\]\['b'\]\[0\]"),
])
def test_non_finite_env_kwargs_are_refused(kwargs, got, example_policy):
    # json.loads takes NaN: CartPole got a truthy sutton_barto_reward, the report said null.
    with pytest.raises(RequestError, match=rf"'env_kwargs' must hold finite numbers \({got}.*"
                       r"NaN and Infinity are not JSON"):
        EvalRequest.build(policy=example_policy, env_kwargs=kwargs)


@pytest.mark.parametrize("fields,message", [
    # The id names OUTPUT/runs/<id>: '../../x' wrote outside the output folder, '' into runs/.
    ({"request_id": ""}, r"'request_id' must be 1-128 letters, digits or '._-', not starting with "
     r"'.' \(got ''\): it names the run's folder"),
    ({"request_id": "../../x"}, r"'request_id' must be .* \(got '../../x'\)"),
    ({"request_id": ".hidden"}, r"'request_id' must be .* \(got '.hidden'\)"),
    ({"request_id": "a" * 129}, r"'request_id' must be 1-128"),
    # An empty callback URL was no callback, silently.
    ({"callback_url": ""}, r"'callback_url' must be an http\(s\) URL .* \(got ''\)"),
    ({"callback_url": "ftp://trainer/x"}, r"'callback_url' must be an http\(s\) URL"),
    ({"callback_url": "http://[::1"}, r"'callback_url' must be an http\(s\) URL"),
    # A bool is an int to Python: episodes=True ran one episode.
    ({"episodes": True}, r"^'episodes' must be an integer, not a bool \(got True\)\.$"),
    ({"step": False, "training_run_id": "r"}, r"'step' must be an integer, not a bool"),
    # Path('') is the current folder: results went wherever the run started.
    ({"output": ""}, r"^'output' is empty: name a folder, e.g. 'results'\.$"),
    ({"cache_dir": " "}, r"'cache_dir' is empty: .* or leave it out for OUTPUT/cache"),
])
def test_ids_urls_integers_and_folders_that_would_misbehave_are_refused(fields, message,
                                                                        example_policy):
    with pytest.raises(RequestError, match=message):
        EvalRequest.build(policy=example_policy, **fields)


def test_the_ids_the_code_generates_are_accepted(example_policy):
    request = EvalRequest.build(policy=example_policy, callback_url="http://127.0.0.1:8080/cb")
    for rid in (request.request_id, f"{request.request_id}-t07", "a" * 128, "run_1.step-3"):
        EvalRequest.build(policy=example_policy, request_id=rid)


def test_a_step_cap_given_twice_must_agree(example_policy):
    # --max-steps won silently, and the report's kwargs showed the other cap.
    with pytest.raises(RequestError, match=r"'max_steps' \(100\) and env_kwargs' "
                       r"'max_episode_steps' \(200\) both cap the episode and disagree: give the "
                       r"cap once, as --max-steps N or as max_episode_steps in --env-kwargs"):
        EvalRequest.build(policy=example_policy, max_steps=100,
                          env_kwargs='{"max_episode_steps": 200}')
    EvalRequest.build(policy=example_policy, max_steps=200, env_kwargs='{"max_episode_steps": 200}')
    EvalRequest.build(policy=example_policy, env_kwargs='{"max_episode_steps": 200}')


def test_bad_env_kwargs_for_the_constructor(no_spawn, example_policy):
    with pytest.raises(EnvSpecError, match=r"could not be made with kwargs \{'gravity': 1\}"):
        _evaluate(policy=example_policy, env_kwargs='{"gravity": 1}')


def test_state_dict_with_factory(tmp_path):
    from evalfleet.envspec import resolve_env
    from evalfleet.policy import receive_policy

    path = tmp_path / "sd.pt"
    torch.save(torch.nn.Linear(4, 2).state_dict(), path)
    env = resolve_env("CartPole-v1", {}, None)
    art = receive_policy(str(path), "tests.flows.factories:linear_4_2", env.observation_space,
                         env.action_space)
    assert art.format == "state_dict" and len(art.sha256) == 64
    with pytest.raises(PolicyError, match="does not fit the module built by"):
        receive_policy(str(path), "tests.flows.factories:linear_4_3", env.observation_space,
                       env.action_space)


def _long_options(parser):
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def test_every_option_is_in_help_and_in_the_readme_table():
    import re
    from pathlib import Path

    from evalfleet.cli import build_parser

    options = _long_options(build_parser())
    assert len(options) >= 37
    text = build_parser().format_help()
    assert [o for o in sorted(options) if o not in text] == []
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start = readme.index("| option | meaning")
    rows = readme[start:readme.index("\n\n", start)].splitlines()[2:]
    documented = {o for row in rows for o in re.findall(r"--[a-z][a-z0-9-]*", row.split(" | ")[0])}
    assert sorted(options - documented) == [], "options missing from README's options table"
    assert sorted(documented - options) == [], "README documents options the CLI does not have"


def test_console_subcommands(tmp_path, capsys):
    from evalfleet.cli import build_parser
    from flows.console import main

    assert main([]) == 0
    usage = capsys.readouterr().out
    assert all(f"\n    {c} " in usage for c in ("eval", "cache", "serve")), usage
    # cache options before or after the subcommand
    for argv in (["cache", "ls", "--output", str(tmp_path)], ["cache", "--output", str(tmp_path), "ls"],
                 ["cache", "ls", "--cache-dir", str(tmp_path / "c")]):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(f"0 entries in {tmp_path / 'cache'}") == 2 and f"0 entries in {tmp_path / 'c'}" in out
    assert main(["cache", "rm", "--output", str(tmp_path)]) == 2
    assert "name keys (or prefixes) to remove, or pass --all" in capsys.readouterr().err
    assert main(["cache", "--cache-dir", str(tmp_path / "c"), "rm", "--all"]) == 0
    assert f"removed 0 entries from {tmp_path / 'c'}" in capsys.readouterr().out

    with pytest.raises(SystemExit) as bad:
        main(["bogus"])
    assert bad.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as extra:
        main(["cache", "ls", "--bogus"])
    assert extra.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as shown:
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert shown.value.code == 0 and text.startswith("usage: evalfleet eval")
    assert [o for o in sorted(_long_options(build_parser())) if o not in text] == []
    # serve's options are its own: everything after the word reaches deployments.cli
    with pytest.raises(SystemExit) as served:
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert served.value.code == 0 and text.startswith("usage: evalfleet serve")
    assert "--ready-file" in text and "--drain-timeout" in text


def test_a_report_path_that_cannot_be_written_fails_before_anything_runs(tmp_path, capsys,
                                                                         example_policy):
    """``--report`` under a regular file: exit 2 with what to do, and no evaluation ran (the
    report would otherwise be lost after the whole run, with a traceback)."""
    from evalfleet.cli import EXIT_BAD_REQUEST, run_cli

    def refuse(request):
        raise AssertionError("the evaluation ran with a --report it cannot write")

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = run_cli(refuse, ["--policy", example_policy, "--episodes", "4",
                            "--output", str(tmp_path / "out"),
                            "--report", str(blocker / "report.json")])
    assert code == EXIT_BAD_REQUEST
    err = capsys.readouterr().err
    assert f"--report '{blocker / 'report.json'}' cannot be written" in err
    assert "folder this user may write to" in err
    report = tmp_path / "reports" / "r.json"  # a folder to be made, a file to be created: fine
    seen = []

    def stop(request):
        seen.append(request)
        raise RequestError("stopped by the test")

    run_cli(stop, ["--policy", example_policy, "--episodes", "4", "--report", str(report)])
    assert seen and report.parent.is_dir() and not report.exists()


def test_a_report_path_that_names_an_input_file_is_refused(tmp_path, capsys, monkeypatch,
                                                          example_policy):
    """``--report my_policy.pt --policy my_policy.pt`` replaced the policy with the report JSON,
    exit 0; so did ``--report`` naming the ``--baseline`` or ``--suite`` file. Refused (exit 2),
    by any name of the same file, before anything runs; the input is left as it was."""
    import shutil

    from evalfleet.cli import EXIT_BAD_REQUEST, run_cli

    def refuse(*args):
        raise AssertionError("the evaluation ran with a --report that overwrites an input")

    policy = tmp_path / "my_policy.pt"
    shutil.copy(example_policy, policy)
    before = policy.read_bytes()
    suite = tmp_path / "suite.toml"
    suite.write_text('[[task]]\nenv = "CartPole-v1"\nepisodes = 4\n')
    (tmp_path / "link.pt").symlink_to(policy)
    monkeypatch.chdir(tmp_path)
    out = ["--output", str(tmp_path / "out")]
    for argv, option, value in [
            (["--policy", str(policy), "--report", str(policy)], "--policy", str(policy)),
            (["--policy", "my_policy.pt", "--report", str(tmp_path / "link.pt")], "--policy",
             "my_policy.pt"),
            (["--baseline", str(policy), "--report", "./my_policy.pt"], "--baseline", str(policy)),
            (["--suite", str(suite), "--report", str(suite)], "--suite", str(suite))]:
        assert run_cli(refuse, [*argv, *out], refuse) == EXIT_BAD_REQUEST
        err = capsys.readouterr().err
        assert (f"--report {argv[-1]!r} is the {option} file {value!r}: writing the report there "
                "would overwrite it. Give --report another path.") in err
    assert policy.read_bytes() == before and suite.read_text().startswith("[[task]]")


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(max_episodes=1000),
         r"'max_episodes' \(1000\) caps an adaptive evaluation and does nothing alone: pass "
         r"--target-ci-halfwidth"),
        (dict(baseline_factory="my_pkg.nets:build_mlp"),
         r"'baseline_factory' \('my_pkg.nets:build_mlp'\) .* no baseline was given: pass --baseline"),
        (dict(outcome_metric="profit", training_run_id="run-1"),
         r"'outcome_metric' \('profit'\) names what the reward-hacking alarm watches .* "
         r"\(training_run_id 'run-1', step None\): pass --training-run-id and --step"),
        (dict(outcome_metric="profit", step=3),
         r"\(training_run_id None, step 3\)"),
        (dict(episodes=10, record_video=20),
         r"'record_video' asks for 20 recorded episodes, but this evaluation runs 10: ask for"),
        (dict(episodes=10, record_trajectories=11, target_ci_halfwidth=1.0, max_episodes=10),
         r"'record_trajectories' asks for 11 recorded episodes, but this evaluation runs 10 for sure"),
        # An adaptive run may stop after its first round: 4 of 6 videos were written, exit 0.
        (dict(episodes=4, record_video=6, target_ci_halfwidth=1000.0, max_episodes=20),
         r"'record_video' asks for 6 recorded episodes, but this evaluation runs 4 for sure \(an "
         r"adaptive one may stop after its first round of --episodes 4\)"),
    ],
)
def test_options_that_would_do_nothing_or_less_are_refused(fields, message, example_policy):
    """Each of these used to be accepted and then silently ignored (or, for recordings, to fail
    only after the whole run): a result asked for is produced, or the request is refused."""
    with pytest.raises(RequestError, match=message):
        EvalRequest.build(policy=example_policy, **fields)


def test_the_same_options_where_they_take_effect_are_accepted(example_policy):
    EvalRequest.build(policy=example_policy, episodes=10, target_ci_halfwidth=1.0, max_episodes=40,
                      record_video=10, record_trajectories=10)
    EvalRequest.build(policy=example_policy, baseline=example_policy, baseline_factory="m:f")
    EvalRequest.build(policy=example_policy, outcome_metric="profit", training_run_id="r", step=0)


def test_a_gate_without_a_training_run_fails_before_anything_runs(tmp_path, capsys, example_policy):
    """``--gate`` without ``--training-run-id``/``--step`` has nothing to compare with: exit 2
    before the evaluation, not after it."""
    from evalfleet.cli import EXIT_BAD_REQUEST, run_cli

    def refuse(request):
        raise AssertionError("the evaluation ran with a --gate that cannot decide")

    for extra in ([], ["--training-run-id", "run-1"], ["--step", "5"]):
        code = run_cli(refuse, ["--policy", example_policy, "--episodes", "4", "--gate",
                                "--output", str(tmp_path / "out"), *extra])
        assert code == EXIT_BAD_REQUEST
        err = capsys.readouterr().err
        assert "--gate compares this evaluation with the best earlier checkpoint" in err
        assert "it needs --training-run-id and --step" in err
    assert not (tmp_path / "out").exists()


def test_a_training_run_id_or_a_step_alone_fails_before_anything_runs(tmp_path, capsys,
                                                                      example_policy):
    """One alone was accepted: the evaluation silently got no history and no verdict."""
    from evalfleet.cli import EXIT_BAD_REQUEST, run_cli

    def refuse(request):
        raise AssertionError("the evaluation ran with half a training checkpoint")

    for extra, got in ((["--training-run-id", "run-1"], "('run-1') and 'step' (None)"),
                       (["--step", "5"], "(None) and 'step' (5)")):
        code = run_cli(refuse, ["--policy", example_policy, "--episodes", "4",
                                "--output", str(tmp_path / "out"), *extra])
        assert code == EXIT_BAD_REQUEST
        err = capsys.readouterr().err
        assert f"'training_run_id' {got} go together" in err, err
        assert "Pass both (--training-run-id RUN --step N), or neither." in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "fields,message",
    [
        # Each was accepted and failed inside the flow, after the cluster started (the seed in
        # stage 2, the NaN target after round 1), or ran with no effect (a NaN episode timeout:
        # every sandboxed episode timed out; an MLflow store that can never answer: queued for
        # ever, exit 0).
        ({"seed": -1}, r"'seed' must be an integer in \[0, 2147483647\] \(got -1\)"),
        ({"seed": 2**31}, r"'seed' must be an integer in \[0, 2147483647\] \(got 2147483648\)"),
        ({"step": -1}, r"'step' must be a training step >= 0 \(got -1\)"),
        ({"episode_timeout_s": float("nan")}, r"'episode_timeout_s' must be > 0 and at most "
         r"1000000 seconds \(about 11.6 days\), or inf for no limit \(got nan\)"),
        # Past threading.TIMEOUT_MAX (or epoll's int milliseconds for the sandboxes'), the shards
        # failed with OverflowError once the cluster was up.
        ({"policy_timeout_s": 1e10}, r"'policy_timeout_s' must be > 0 and at most 1000000 seconds"
         r".*or inf for no limit \(got 10000000000.0\)"),
        ({"step_timeout_s": 2e6}, r"'step_timeout_s' must be > 0 and at most 1000000 seconds"),
        # A plan of 1e12 episodes died of a bare MemoryError (exit 1).
        ({"episodes": 10**12}, r"'episodes' must be at most 100,000,000 \(got 1,000,000,000,000\): "
         r"the driver plans every episode's index and seed in memory"),
        ({"target_ci_halfwidth": 1.0, "max_episodes": 10**9},
         r"'max_episodes' must be at most 100,000,000 \(got 1,000,000,000\)"),
        # Its bytes overflowed setrlimit in every sandbox: every episode 'crashed' (exit 3).
        ({"sandbox_memory_mb": 10**13}, r"'sandbox_memory_mb' must be at most 134217728 MiB "
         r"\(128 TiB.*got 10000000000000\): a larger limit does not fit the sandboxes' RLIMIT_AS"),
        ({"target_ci_halfwidth": float("nan"), "max_episodes": 600},
         r"'target_ci_halfwidth' must be a finite number > 0 \(got nan\)"),
        ({"experiment": " "}, r"'experiment' is empty"),
        ({"mlflow_uri": "bogus://x"}, r"no MLflow store serves the scheme 'bogus'"),
    ],
)
def test_values_that_failed_late_or_did_nothing_are_refused_up_front(fields, message,
                                                                     example_policy):
    with pytest.raises(RequestError, match=message):
        EvalRequest.build(policy=example_policy, **fields)


def test_an_infinite_policy_timeout_is_no_bound_not_an_overflow(example_policy):
    # A wait of inf seconds overflowed time_t: the shard failed (exit 1) after the cluster started.
    from tests.core.episodes import run_in_process

    request = EvalRequest.build(policy=example_policy, policy_timeout_s=float("inf"))
    table = run_in_process("CartPole-v1", example_policy, 4, cap=30, slots=2,
                           policy_timeout_s=request.policy_timeout_s)
    assert table.column("end_reason").to_pylist() == ["truncated"] * 4


@pytest.mark.parametrize("where", ["output", "cache_dir"])
def test_an_output_or_cache_folder_that_is_a_file_fails_before_anything_runs(
        no_spawn, tmp_path, example_policy, where):
    # It failed after every episode ran (stage 7's NotADirectoryError) or once the cluster was
    # up (the cache lock's FileExistsError).
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fields = {"output": tmp_path / "out", where: blocker / "sub" if where == "output" else blocker}
    with pytest.raises(RequestError, match=r"cannot be a folder: '.*a-file' is a file"):
        _evaluate(policy=example_policy, episodes=4, **fields)
    assert not (tmp_path / "out").exists()  # nothing made


def test_an_mlflow_store_that_can_never_be_made_fails_before_anything_runs(
        no_spawn, tmp_path, example_policy):
    # Before, the run was queued for a store under /proc and the evaluation exited 0.
    with pytest.raises(RequestError, match=r"--mlflow-uri '/proc/evalfleet-nope' cannot be "
                       r"written: this user may not write in '/proc'"):
        _evaluate(policy=example_policy, episodes=4, output=tmp_path / "out",
                  mlflow_uri="sqlite:////proc/evalfleet-nope/mlflow.db")
    assert not (tmp_path / "out").exists()


def test_a_missing_baseline_file_is_named_as_the_baseline(no_spawn, tmp_path, example_policy):
    # Before: "policy file ... does not exist ... --policy-factory", about a policy that was fine.
    missing = tmp_path / "nonexistent.pt"
    with pytest.raises(RequestError) as err:
        _evaluate(policy=example_policy, episodes=4, output=tmp_path / "out", baseline=str(missing))
    text = str(err.value)
    assert text.startswith(f"--baseline {str(missing)!r}: ") and "does not exist" in text
    assert "--policy-factory" not in text
    assert not (tmp_path / "out").exists()


def test_sandbox_options_for_an_in_process_evaluation_are_refused(no_spawn, tmp_path,
                                                                  example_policy):
    with pytest.raises(RequestError, match=r"--sandbox-read, --episode-timeout apply to "
                       r"process/bwrap sandboxes, but this evaluation runs its envs in-process "
                       r"\(isolation 'auto' for 'CartPole-v1'\)"):
        _evaluate(policy=example_policy, episodes=4, output=tmp_path, episode_timeout_s=5,
                  sandbox_read=["/data"])


@pytest.mark.parametrize("address,message", [
    ("garbage", r"missing port number"), ("http://127.0.0.1:8786", r"unknown address scheme 'http'")])
def test_a_malformed_dask_address_is_a_request_error(no_spawn, tmp_path, example_policy, address,
                                                     message):
    with pytest.raises(RequestError, match=rf"--dask-address '{address}' is no Dask scheduler "
                       rf"address \(.*{message}"):
        _evaluate(policy=example_policy, episodes=4, output=tmp_path, dask_address=address)


def test_no_cache_and_refresh_together_are_refused(capsys):
    from evalfleet.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--no-cache", "--refresh"])
    assert exit_.value.code == 2
    assert "argument --refresh: not allowed with argument --no-cache" in capsys.readouterr().err


def test_a_whole_request_check_prints_its_message_not_the_whole_request(example_policy):
    # It read "'request': Unknown device 'gpu'. ... (got {...every field of the request...})".
    with pytest.raises(RequestError) as err:
        EvalRequest.build(policy=example_policy, device="gpu")
    assert str(err.value) == "Unknown device 'gpu'. Choose 'auto', 'cpu', 'cuda' or 'cuda:N'."


def test_a_policy_for_other_observations_says_so_in_one_line(no_spawn, tmp_path):
    # It printed ~28 lines of TorchScript traceback, the cause on the last, the shape nowhere.
    path = tmp_path / "in8.pt"
    torch.jit.save(torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 2))), str(path))
    with pytest.raises(PolicyError) as err:
        _evaluate(policy=str(path), output=tmp_path)
    text = str(err.value)
    assert text.endswith("failed on a dummy float32 batch of shape (4, 4) (the env's observations "
                         "have shape (4,)): RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                         "(4x4 and 8x2)"), text
    assert "\n" not in text
