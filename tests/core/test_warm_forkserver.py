"""The shared fork server: used only while it is what a run's own would be, its imports unchanged."""

import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from evalfleet import warm_forkserver as warm
from evalfleet.server import alive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A home, and a module the server preloads from a folder of its own."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "wfs_probe.py").write_text("VALUE = 1\n")
    (folder / "wfs_pkg").mkdir()
    (folder / "wfs_pkg" / "__init__.py").write_text("")
    (folder / "wfs_pkg" / "levels.txt").write_text("1 2 3\n")  # data its code reads, not a module
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    started: list[int] = []
    yield folder / "wfs_probe.py", env, started
    warm.detach()
    for pid in started:
        if alive(pid):
            os.kill(pid, 9)
    record = warm.read_record()
    if record is not None and record.address:  # a killed server's socket folder
        shutil.rmtree(Path(record.address).parent, ignore_errors=True)


def _ready(timeout: float = 60.0) -> warm.WarmRecord:
    deadline = time.monotonic() + timeout
    while (record := warm.read_record()) is None or record.manifest is None:
        log = warm.record_path().with_suffix(".log")
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.1)
    return record


def _what_the_child_sees(queue) -> None:
    print("printed by the child", flush=True)  # reaches the run's stdout, not the server's log
    os.write(2, b"written to the child's stderr\n")
    queue.put((os.getppid(), "wfs_probe" in sys.modules, sys.modules["wfs_probe"].VALUE, os.getcwd()))


def test_a_run_forks_from_the_shared_server_only_while_its_imports_are_the_files_on_disk(probe, capfd):
    module, env, started = probe
    modules = ("wfs_probe",)
    wanted = warm.key(modules, env)
    started.append(warm.spawn(modules, env, wanted, str(ROOT)))
    record = _ready()
    assert record.pid == started[0] and str(module) in record.manifest
    assert warm.usable(wanted) is None  # not opted in: an Evaluator, a test, a script
    with warm.opted_in():
        assert warm.usable(wanted) == record

        warm.attach(record, lambda: None)  # the child: forked from it, its imports, our folder
        try:
            ctx = multiprocessing.get_context("forkserver")
            queue = ctx.SimpleQueue()
            child = ctx.Process(target=_what_the_child_sees, args=(queue,))
            child.start()
            child.join(30)
            assert child.exitcode == 0
            assert queue.get() == (record.pid, True, 1, os.getcwd())
        finally:
            warm.detach()
        out, err = capfd.readouterr()
        assert "printed by the child" in out and "written to the child's stderr" in err
        assert "printed by the child" not in warm.record_path().with_suffix(".log").read_text()

        # Another environment, another kind of server: not this one.
        assert warm.usable(warm.key(modules, {**env, "OMP_NUM_THREADS": "7"})) is None
        # The shell's own bookkeeping is no difference.
        assert warm.key(modules, {**env, "_": "/usr/bin/timeout", "SHLVL": "3"}) == wanted
        before = os.umask(0o077)
        try:
            assert warm.key(modules, env) != wanted
        finally:
            os.umask(before)

        module.write_text("VALUE = 2\n")  # an edited module: its old import must not serve
        assert warm.usable(wanted) is None
    assert warm.stop() == record
    deadline = time.monotonic() + 10
    while alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(record.pid) and warm.read_record() is None
    assert not Path(record.address).parent.exists()  # its socket's folder went with it


def test_an_unused_shared_server_exits_and_leaves_nothing(probe):
    _, env, started = probe
    modules = ("wfs_probe",)
    env = {**env, warm.IDLE_ENV: "1"}
    started.append(warm.spawn(modules, env, warm.key(modules, env), str(ROOT)))
    record = _ready()
    deadline = time.monotonic() + 20
    while alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(record.pid)
    assert not Path(record.address).parent.exists()
    assert "no shared fork server" in warm.describe()


def test_a_server_whose_record_names_another_is_not_used(probe):
    _, env, started = probe
    modules = ("wfs_probe",)
    wanted = warm.key(modules, env)
    started.append(warm.spawn(modules, env, wanted, str(ROOT)))
    record = _ready()
    os.kill(record.pid, 9)  # gone without a word: its record stays, naming a dead process
    deadline = time.monotonic() + 10
    while alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with warm.opted_in():
        assert warm.usable(wanted) is None


def test_an_edited_data_file_of_a_package_it_imported_retires_it_too(probe):
    """A worker judges a source package by its whole tree: edited after the server imported it,
    its workers were refused as stale (exit 7) although every module file was unchanged."""
    module, env, started = probe
    modules = ("wfs_probe", "wfs_pkg")
    wanted = warm.key(modules, env)
    started.append(warm.spawn(modules, env, wanted, str(ROOT)))
    record = _ready()
    levels = module.parent / "wfs_pkg" / "levels.txt"
    assert str(levels) in record.manifest
    assert str(ROOT / "evalfleet" / "templates" / "report.html.j2") in record.manifest
    with warm.opted_in():
        assert warm.usable(wanted) == record
        levels.write_text("1 2 3 4\n")
        assert warm.usable(wanted) is None


def _key_in_a_child(change, env) -> str:
    """``key`` as a forked child of this process computes it after ``change()``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one key, then out
        try:
            change()
            os.write(write, warm.key(("wfs_probe",), env).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        out = answer.read()
    os.waitpid(pid, 0)
    return out


@pytest.mark.parametrize("change", ["nothing", "nice", "affinity", "capabilities"])
def test_a_run_with_other_privileges_or_scheduling_is_another_kind(change, probe):
    """Its workers would have had the server's niceness, CPUs or capabilities, not the run's own."""
    import ctypes

    _, env, _ = probe

    def apply() -> None:
        if change == "nice":
            os.nice(5)
        elif change == "affinity":
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        elif change == "capabilities":  # drop CAP_NET_RAW (13) from the bounding set
            ctypes.CDLL(None, use_errno=True).prctl(24, 13, 0, 0, 0)

    if change == "affinity" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU allowed: no narrower affinity to set")
    status = warm._inherited_status()
    if change == "capabilities" and not (int(status["CapEff"], 16) >> 8 & 1
                                         and int(status["CapBnd"], 16) >> 13 & 1):
        pytest.skip("no CAP_SETPCAP here (or CAP_NET_RAW bounded already): nothing to drop")
    ours = warm.key(("wfs_probe",), env)
    theirs = _key_in_a_child(apply, env)
    assert (theirs == ours) is (change == "nothing")


def test_a_run_whose_shared_server_died_starts_a_private_one_instead_of_waiting(probe):
    """Killed after the run took it (out of memory, a stray signal), the server left a run whose
    workers could never start: its nannies waited on a socket no one served."""
    _, env, started = probe
    modules = ("wfs_probe",)
    wanted = warm.key(modules, env)
    started.append(warm.spawn(modules, env, wanted, str(ROOT)))
    record = _ready()
    fallback: list[str] = []
    with warm.opted_in():
        warm.attach(warm.usable(wanted), lambda: fallback.append("private"))
    os.kill(record.pid, 9)
    deadline = time.monotonic() + 10
    while alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver.ensure_running()
    assert fallback == ["private"] and not warm.attached()
