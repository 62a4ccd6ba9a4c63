"""``evalfleet serve``: the whole evaluation service, locally, with one command.

It starts, in order, and waits (bounded) for each to be ready:

1. a Prefect server (``prefect server start``), unless ``--prefect-api-url`` names one;
2. a Dask cluster (a ``LocalCluster`` of ``--workers`` processes in this process), unless
   ``--dask-address`` names one;
3. the served deployment (``python -m deployments.serve``);
4. the webhook receiver (``python -m deployments.webhook``).

Child processes run in their own sessions and their output is prefixed and echoed here (and kept
in ``STATE_DIR/logs``). On Ctrl-C / SIGTERM, or if any child dies, the receiver stops first so no
new work comes in, running evaluations get ``--drain-timeout`` seconds to finish (runs not yet
started stay SCHEDULED in Prefect's database, visible in the UI), then the rest stop in reverse
order: SIGTERM to each process group, SIGKILL after ``--stop-grace``. Each piece can also be
started by hand, as the README's process list shows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from deployments import (
    DASK_ADDRESS_ENV,
    DEPLOYMENT,
    WEBHOOK_PREVIOUS_SECRET_ENV,
    WEBHOOK_SECRET_ENV,
    at_least_one,
    poll_seconds,
    resolve_secret,
)
from deployments.webhook import add_egress_options
from deployments.webhook.receiver import check_service_settings
from evalfleet.callback import CALLBACK_SECRET_ENV
from evalfleet.egress import ALLOWED_HOSTS_ENV, PUBLIC_ENV
from evalfleet.redaction import register_secret


class StartupError(RuntimeError):
    """A component did not become ready in time, or exited while starting."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Refuse to start ``what`` on ``port`` when something already listens there.

    Its health check would be answered by that other process (the shared local Prefect server
    ``python flows/eval.py`` keeps on 4200): the service said "ready", then its own server
    failed to bind and the whole service shut down.
    """
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            raise StartupError(
                f"port {port} on {host} is already in use, so {what} cannot start there (the "
                "shared local Prefect server, 'evalfleet server status', is often on 4200): pass "
                f"{flag} 0 for any free port"
                + (", or --prefect-api-url URL to use the server already running." if
                   flag == "--prefect-port" else "."))


class Child:
    """One supervised process: own session, output prefixed onto ``sink`` and kept in a log."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path,
                 sink: IO[str]) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("a", encoding="utf-8")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True, errors="replace",
        )
        self._sink = sink
        self._pump = threading.Thread(target=self._copy, name=f"log-{name}", daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        if self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            try:
                self._sink.write(f"[{self.name}] {line}")
                self._sink.flush()
            except (ValueError, OSError):
                pass  # our stdout is gone (closed pipe); the log file still has it

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        """The end of the child's log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds (idempotent)."""
        if self._log.closed:
            return
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=5)
        else:
            try:  # the leader exited; make sure nothing it started outlives it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._pump.join(timeout=2)
        self._log.close()


def wait_until(ready: Callable[[], bool], what: str, timeout: float,
               child: Child | None = None, interval: float = 0.5) -> float:
    """Poll ``ready`` until true; returns seconds waited. Bounded by ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if child is not None and not child.alive():
            raise StartupError(f"{what}: process exited with {child.proc.returncode}:\n"
                               f"{child.tail()}")
        try:
            if ready():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    tail = f"\n{child.tail()}" if child is not None else ""
    raise StartupError(f"{what} not ready after {timeout:.0f} s{tail}")


def _status(url: str) -> int:
    return httpx.get(url, timeout=3).status_code


def deployment_polled_since(api_url: str, deployment: str, since: float) -> bool:
    """True once a runner has polled for ``deployment`` after unix time ``since``.

    A deployment left in the database by an earlier run exists before our runner does; its
    ``last_polled`` only moves once this runner is up.
    """
    from datetime import datetime

    response = httpx.get(f"{api_url}/deployments/name/{deployment}", timeout=3)
    if response.status_code != 200:
        return False
    polled = response.json().get("last_polled")
    if not polled:
        return False
    return datetime.fromisoformat(polled.replace("Z", "+00:00")).timestamp() >= since - 1


def withhold_service_secrets() -> dict[str, str]:
    """Move the service's secrets out of ``os.environ`` (children get them explicitly).

    Dask workers started from this process inherit its environment, and an ``inprocess`` env
    runs inside a worker: no signing secret may be there to read. The values stay registered
    with :mod:`evalfleet.redaction`, so texts this process writes are still scrubbed of them.
    Returns what was removed.
    """
    removed = {}
    for name in (WEBHOOK_SECRET_ENV, WEBHOOK_PREVIOUS_SECRET_ENV, CALLBACK_SECRET_ENV):
        value = os.environ.pop(name, None)
        if value is not None:
            register_secret(name, value)
            removed[name] = value
    return removed


class Service:
    """The running service: children, cluster, and the URLs that reach them."""

    def __init__(self, args: argparse.Namespace, sink: IO[str] = sys.stdout) -> None:
        self.args = args
        self.sink = sink
        self.state_dir = Path(args.state_dir).resolve()
        self.children: list[Child] = []
        self.stack = ExitStack()
        self.urls: dict[str, str] = {}

    def say(self, message: str) -> None:
        """One line of the supervisor's own output."""
        self.sink.write(f"[evalfleet] {message}\n")
        self.sink.flush()

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        env.setdefault("PREFECT_HOME", str(self.state_dir / "prefect"))
        env.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, env, self.state_dir / "logs", self.sink)
        self.children.append(child)
        return child

    def start(self) -> dict[str, str]:
        """Start every component; returns the URLs. Raises ``StartupError`` on failure."""
        a = self.args
        timeout = a.startup_timeout
        py = sys.executable
        # Ports asked for are free, or nothing starts (another process would answer for them).
        if not a.prefect_api_url and a.prefect_port:
            check_port_free(a.host, a.prefect_port, "the Prefect server", "--prefect-port")
        if a.port:
            check_port_free(a.host, a.port, "the webhook receiver", "--port")
        # 1. Prefect server
        api = a.prefect_api_url
        if not api:
            port = a.prefect_port or free_port(a.host)
            api = f"http://{a.host}:{port}/api"
            child = self._spawn("prefect", [py, "-m", "prefect", "server", "start", "--host",
                                            a.host, "--port", str(port)],
                                self._env(PREFECT_API_URL=api))
            took = wait_until(lambda: _status(f"{api}/health") == 200, "Prefect server",
                              timeout, child)
            self.say(f"Prefect server ready in {took:.1f} s: {api.removesuffix('/api')}")
        else:
            wait_until(lambda: _status(f"{api}/health") == 200, f"Prefect API {api}", 30)
        os.environ["PREFECT_API_URL"] = api  # for a Secret block lookup below
        secret = resolve_secret(WEBHOOK_SECRET_ENV, a.secret_block)
        if not secret:
            raise StartupError(
                f"no webhook secret: export {WEBHOOK_SECRET_ENV}=<random string shared with the "
                "trainer> (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`), or "
                "pass --secret-block NAME of a Prefect Secret block."
            )
        callback_secret = resolve_secret(CALLBACK_SECRET_ENV, a.callback_secret_block) or secret
        withheld = withhold_service_secrets()
        register_secret(WEBHOOK_SECRET_ENV, secret)  # from a Secret block, say
        register_secret(CALLBACK_SECRET_ENV, callback_secret)
        # 2. Dask cluster (its workers start from this process's environment, now secret-free)
        address = a.dask_address
        if not address:
            from evalfleet.cluster import fleet_cluster

            address = self.stack.enter_context(fleet_cluster(None, a.workers))
            self.say(f"Dask LocalCluster with {a.workers} workers: {address}")
        # One egress policy for the receiver (policy.uri, callback_url at POST time) and the
        # flow runs (callbacks at send time): both read it from the environment.
        egress: dict[str, str] = {}
        if a.allow_host is not None:
            egress[ALLOWED_HOSTS_ENV] = ",".join(a.allow_host)
        if a.no_public_egress:
            egress[PUBLIC_ENV] = "0"
        env = self._env(PREFECT_API_URL=api, **{**withheld, DASK_ADDRESS_ENV: address,
                                                  WEBHOOK_SECRET_ENV: secret,
                                                  CALLBACK_SECRET_ENV: callback_secret}, **egress)
        # 3. Served deployment: it signs callbacks, it never checks webhooks
        serve_env = {k: v for k, v in env.items()
                     if k not in (WEBHOOK_SECRET_ENV, WEBHOOK_PREVIOUS_SECRET_ENV)}
        since = time.time()
        child = self._spawn("serve", [py, "-m", "deployments.serve", "--dask-address", address,
                                      "--limit", str(a.limit), "--poll", str(a.poll)], serve_env)
        took = wait_until(lambda: deployment_polled_since(api, DEPLOYMENT, since),
                          f"deployment {DEPLOYMENT}", timeout, child)
        self.say(f"deployment {DEPLOYMENT} served in {took:.1f} s")
        # 4. Webhook receiver
        port = a.port or free_port(a.host)
        receiver = f"http://{a.host}:{port}"
        argv = [py, "-m", "deployments.webhook", "--host", a.host, "--port", str(port),
                "--prefect-api-url", api, "--state-dir", str(self.state_dir),
                "--output", str(Path(a.output).resolve()), "--experiment", a.experiment,
                "--isolation", a.isolation, "--max-policy-bytes", str(a.max_policy_bytes),
                "--log-level", "warning"]
        for root in a.policy_root:
            argv += ["--policy-root", root]
        if a.mlflow_uri:
            argv += ["--mlflow-uri", a.mlflow_uri]
        child = self._spawn("receiver", argv, env)
        took = wait_until(lambda: _status(f"{receiver}/healthz") == 200, "webhook receiver",
                          timeout, child)
        self.say(f"webhook receiver ready in {took:.1f} s: POST {receiver}/v1/evaluations")
        self.urls = {"prefect_api": api, "prefect_ui": api.removesuffix("/api"),
                     "dask": address, "receiver": receiver,
                     "evaluations": f"{receiver}/v1/evaluations",
                     "output": str(Path(a.output).resolve()), "state_dir": str(self.state_dir)}
        return self.urls

    def first_dead(self) -> Child | None:
        """A child that exited on its own, if any."""
        return next((c for c in self.children if not c.alive()), None)

    def running_evaluations(self) -> int:
        """Flow runs of the deployment that are executing now (PENDING or RUNNING)."""
        api = self.urls.get("prefect_api")
        if not api:
            return 0
        response = httpx.post(f"{api}/flow_runs/count", timeout=5, json={
            "deployments": {"name": {"any_": [DEPLOYMENT.split("/")[1]]}},
            "flow_runs": {"state": {"type": {"any_": ["PENDING", "RUNNING"]}}},
        })
        response.raise_for_status()
        return int(response.json())

    def drain(self, timeout: float) -> None:
        """Let running evaluations finish (bounded) before their processes are stopped.

        Runs not started yet stay SCHEDULED in Prefect's database (under ``--state-dir`` when
        this command started the server), visible in the UI; they are not deleted.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                running = self.running_evaluations()
            except httpx.HTTPError:
                return
            if not running:
                return
            self.say(f"waiting for {running} running evaluation(s) (up to "
                     f"{deadline - time.monotonic():.0f} s more)")
            time.sleep(2)
        self.say("drain timeout: stopping running evaluations")

    def stop(self) -> None:
        """Stop the receiver, let running evaluations end, then the rest in reverse order."""
        serve = next((c for c in self.children if c.name == "serve"), None)
        receiver = next((c for c in self.children if c.name == "receiver"), None)
        if receiver is not None and serve is not None and serve.alive():
            self.say("stopping receiver")
            receiver.stop(grace=self.args.stop_grace)  # no new work while draining
            self.drain(self.args.drain_timeout)
        for child in reversed(self.children):
            if child.alive():
                self.say(f"stopping {child.name}")
            child.stop(grace=self.args.stop_grace)
        self.children.clear()
        self.stack.close()


def build_parser() -> argparse.ArgumentParser:
    """Options of ``evalfleet serve`` (also ``python -m deployments.cli``)."""
    s = argparse.ArgumentParser(
        prog="evalfleet serve",
        description=f"Run the evaluation service locally: Prefect server, Dask cluster, served "
        f"deployment, webhook receiver. Needs ${WEBHOOK_SECRET_ENV} (or --secret-block); "
        f"${CALLBACK_SECRET_ENV} signs report callbacks (default: the webhook secret).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--host", default="127.0.0.1", help="interface every component binds to")
    s.add_argument("--port", type=int, default=8700, help="webhook receiver port (0: any free)")
    s.add_argument("--prefect-api-url", default=None,
                   help="use this Prefect server instead of starting one")
    s.add_argument("--prefect-port", type=int, default=4200,
                   help="port of the Prefect server started here (0: any free)")
    s.add_argument("--dask-address", default=None, help="use this Dask scheduler instead")
    s.add_argument("--workers", type=at_least_one, default=2, help="local Dask worker processes")
    s.add_argument("--limit", type=at_least_one, default=2, help="evaluations running at once")
    s.add_argument("--poll", type=poll_seconds, default=1,
                   help="deployment poll interval, whole seconds >= 1")
    s.add_argument("--state-dir", default=".evalfleet",
                   help="PREFECT_HOME (if unset), receiver store, policy copies, logs")
    s.add_argument("--output", default="results", help="results folder (Parquet, reports, MLflow)")
    s.add_argument("--mlflow-uri", default=None, help="MLflow URI (default: under --output)")
    s.add_argument("--experiment", default="evalfleet", help="default MLflow experiment")
    s.add_argument("--isolation", default="auto",
                   help="sandbox level of every evaluation (auto: gymnasium's and evalfleet's "
                   "envs inprocess, others in process sandboxes)")
    s.add_argument("--secret-block", default=None, help="Prefect Secret block: webhook secret")
    s.add_argument("--callback-secret-block", default=None,
                   help="Prefect Secret block: callback secret")
    add_egress_options(s)
    s.add_argument("--ready-file", default=None,
                   help="write the service's URLs here as JSON once everything is ready")
    s.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds each component may take to become ready")
    s.add_argument("--stop-grace", type=float, default=15.0,
                   help="seconds each component gets to exit after SIGTERM")
    s.add_argument("--drain-timeout", type=float, default=120.0,
                   help="on shutdown, seconds to let running evaluations finish")
    return s


def serve(args: argparse.Namespace) -> int:
    """Run the service until a signal arrives or a component dies."""
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    check_service_settings(isolation=args.isolation, output=Path(args.output).resolve(),
                           mlflow_uri=args.mlflow_uri, experiment=args.experiment)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    service = Service(args)
    code = 0
    try:
        urls = service.start()
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(urls, indent=2) + "\n")
        service.say("ready. " + "  ".join(f"{k}={v}" for k, v in urls.items()))
        service.say("Ctrl-C stops everything")
        while not stop.wait(0.5):
            dead = service.first_dead()
            if dead is not None:
                service.say(f"{dead.name} exited with {dead.proc.returncode}; shutting down "
                            f"(log: {dead.log_path})")
                code = 1
                break
    except StartupError as err:
        service.say(f"startup failed: {err}")
        code = 1
    finally:
        service.stop()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``evalfleet serve``: ``flows/console.py`` passes the arguments after ``serve``."""
    from evalfleet.tracking import telemetry_off

    telemetry_off()  # the service is evalfleet's own process: MLflow sends nothing home from it
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:  # python -m deployments.cli serve ... reads naturally too
        args = args[1:]
    return serve(build_parser().parse_args(args))


if __name__ == "__main__":
    raise SystemExit(main())
