"""REINFORCE on CartPole, evaluated through the evalfleet service's webhook.

The trainer knows nothing of Prefect or Dask: after each update it saves the policy
(TorchScript), and POSTs a signed JSON webhook naming the file, its sha256, the env, the
protocol, its MLflow run id, the step and a callback URL. The service answers 202 at once;
when the evaluation ends, the report arrives at the callback URL, HMAC-signed, and the trainer
verifies it before using it. Reports that never arrive by callback are fetched from the status
URL instead (a failed callback never loses a result).

    # everything in one go (starts `evalfleet serve` in the background, stops it at the end):
    python examples/train_with_webhook.py
    # against a running service (same secret; same --output/--mlflow-uri to share MLflow):
    # (--allow-host: this trainer's callback listens on loopback; --prefect-port 0: any free
    # port, 4200 is often the shared local server's)
    export EVALFLEET_WEBHOOK_SECRET=...
    evalfleet serve --output results/webhook --allow-host 127.0.0.1 --prefect-port 0 &
    python examples/train_with_webhook.py --receiver-url http://127.0.0.1:8700 \\
        --mlflow-uri sqlite:///$PWD/results/webhook/mlflow.db

Policy files go to --policy-dir, which the service must be able to read (same host here).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import gymnasium as gym
import httpx
import numpy as np
import torch
from train_reinforce import TrainingRun, collect, init_policy, reinforce_loss

from evalfleet.callback import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    canonical_json,
    signed_headers,
    signed_read_headers,
    verify,
)
from evalfleet.tracking import default_tracking_uri

logger = logging.getLogger("train_with_webhook")


class CallbackServer:
    """The trainer's endpoint for reports: verifies each signature, queues the verified ones."""

    def __init__(self, secret: str, host: str = "127.0.0.1") -> None:
        self.reports: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.rejected = 0
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                delivery = self.headers.get(DELIVERY_HEADER, "")
                try:  # the delivery id is signed with the body
                    verify(body, self.headers.get(SIGNATURE_HEADER),
                           self.headers.get(TIMESTAMP_HEADER), secret, delivery_id=delivery)
                except SignatureError as err:
                    outer.rejected += 1
                    logger.warning("rejected a callback: %s", err)
                    self.send_response(401)
                    self.end_headers()
                    return
                event = self.headers.get("X-Evalfleet-Event", "evaluation.completed")
                with outer.lock:  # retries and re-sends reuse a delivery id: handle it once
                    first = delivery not in outer.seen
                    outer.seen.add(delivery)
                if first:
                    outer.reports.put((event, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self._server.server_port}/evalfleet/report"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class LocalService:
    """`evalfleet serve` as a child process, for running this example on its own."""

    def __init__(self, output: Path, mlflow_uri: str, secret: str, workers: int,
                 timeout: float = 240) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="evalfleet-example-"))
        ready = self.state / "ready.json"
        env = dict(os.environ, EVALFLEET_WEBHOOK_SECRET=secret, EVALFLEET_CALLBACK_SECRET=secret,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        env.pop("PREFECT_API_URL", None)
        self.log = (self.state / "service.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.cli", "--port", "0", "--prefect-port",
             "0", "--workers", str(workers), "--state-dir", str(self.state / "state"),
             "--output", str(output), "--mlflow-uri", mlflow_uri, "--ready-file", str(ready),
             # our callback endpoint listens on loopback: allowed explicitly (refused by default)
             "--allow-host", "127.0.0.1"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"evalfleet serve did not start; see {self.log.name}")
            time.sleep(0.5)
        self.urls: dict[str, str] = json.loads(ready.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the supervisor stops its children in order
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def save_policy(policy: torch.nn.Module, folder: Path, step: int) -> tuple[Path, str]:
    """The policy as a self-contained TorchScript file; returns (path, sha256)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates TorchScript
        scripted = torch.jit.script(copy.deepcopy(policy).eval())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"policy-step{step:04d}.pt"
    torch.jit.save(scripted, str(path))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def request_evaluation(client: httpx.Client, url: str, secret: str, doc: dict[str, Any]
                       ) -> dict[str, Any]:
    """POST one signed webhook; retries transient failures with the same delivery id."""
    body = canonical_json(doc)
    delivery = uuid.uuid4().hex
    for attempt in range(5):
        try:
            r = client.post(url, content=body, headers=signed_headers(body, secret,
                                                                      delivery_id=delivery))
            if r.status_code in (200, 202):
                answer: dict[str, Any] = r.json()
                return answer
            if r.status_code < 500:
                raise RuntimeError(f"webhook refused: {r.status_code} {r.text}")
        except httpx.TransportError as err:
            logger.warning("webhook attempt %d failed: %s", attempt + 1, err)
        time.sleep(0.5 * 2**attempt)
    raise RuntimeError("webhook not accepted after 5 attempts")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--receiver-url", default=None,
                   help="a running receiver; default: start `evalfleet serve` here")
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-episodes", type=int, default=32)
    p.add_argument("--eval-seed", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2, help="Dask workers of a service started here")
    p.add_argument("--output", default="results/webhook", help="results + MLflow folder")
    p.add_argument("--mlflow-uri", default=None, help="default: sqlite:///OUTPUT/mlflow.db")
    p.add_argument("--experiment", default="reinforce-cartpole-webhook")
    p.add_argument("--policy-dir", default=None, help="default: OUTPUT/trainer-policies")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for reports")
    p.add_argument("--summary", default=None, help="write the results here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    output = Path(args.output).resolve()
    tracking_uri = args.mlflow_uri or default_tracking_uri(output)
    policy_dir = Path(args.policy_dir or output / "trainer-policies").resolve()
    secret = os.environ.get("EVALFLEET_WEBHOOK_SECRET", "")
    service = None
    if args.receiver_url is None:
        secret = secret or secrets.token_hex(32)
        print("starting evalfleet serve (Prefect server, Dask cluster, deployment, receiver)...")
        t = time.monotonic()
        service = LocalService(output, tracking_uri, secret, args.workers)
        receiver = service.urls["receiver"]
        print(f"service ready in {time.monotonic() - t:.0f} s: {service.urls['prefect_ui']} "
              f"(Prefect UI), {receiver} (webhooks)")
    else:
        receiver = args.receiver_url.rstrip("/")
        if not secret:
            raise SystemExit("set EVALFLEET_WEBHOOK_SECRET to the service's secret")
    callback_secret = os.environ.get("EVALFLEET_CALLBACK_SECRET") or secret
    callbacks = CallbackServer(callback_secret)
    run = TrainingRun(tracking_uri, args.experiment, {k: v for k, v in vars(args).items()
                                                      if k not in ("summary", "receiver_url")})
    print(f"training run {run.run_id} in experiment {args.experiment!r} at {tracking_uri}")

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy = init_policy(args.seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    envs = [gym.make("CartPole-v1") for _ in range(args.batch)]
    train_curve: dict[int, float] = {}
    accepted: dict[str, dict[str, Any]] = {}   # evaluation id -> 202 answer
    sent_at: dict[str, float] = {}
    reports: dict[str, dict[str, Any]] = {}    # evaluation id -> report
    latency: dict[str, float] = {}

    def drain(block_s: float = 0.0) -> None:
        deadline = time.monotonic() + block_s
        while True:
            try:
                event, doc = callbacks.reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            eid = str(doc.get("request_id"))
            if event != "evaluation.completed":
                print(f"  eval {eid} ended {doc.get('state')}: {doc.get('message')}")
                reports[eid] = {"failed": doc}
                continue
            latency[eid] = time.monotonic() - sent_at.get(eid, time.monotonic())
            reports[eid] = doc
            r = doc["returns"]
            print(f"  eval  step {doc['step']:>3}: return {r['mean']:7.1f} "
                  f"[{r['ci']['low']:.1f}, {r['ci']['high']:.1f}]  (callback "
                  f"{latency[eid]:.1f} s after the webhook)")
            if doc.get("outputs", {}).get("mlflow_uri") != tracking_uri:
                # evalfleet logs the eval curve into the training run itself when both live in
                # one store; a service with another store leaves it to the trainer.
                run.log({"eval/reward": r["mean"], "eval/reward_ci_low": r["ci"]["low"],
                         "eval/reward_ci_high": r["ci"]["high"]}, step=int(doc["step"]))

    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=30) as client:
            for step in range(1, args.updates + 1):
                batch = collect(policy, envs, rng, gen)
                loss = reinforce_loss(batch, args.gamma)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                train_curve[step] = float(np.mean(batch.returns))
                run.log({"train/return": train_curve[step], "train/loss": loss.item()}, step=step)
                path, sha = save_policy(policy, policy_dir, step)
                sent = time.monotonic()
                answer = request_evaluation(client, f"{receiver}/v1/evaluations", secret, {
                    "policy": {"uri": path.as_uri(), "sha256": sha},
                    "env": {"id": "CartPole-v1"},
                    "protocol": {"episodes": args.eval_episodes, "seed": args.eval_seed},
                    "training_run_id": run.run_id, "step": step,
                    "callback_url": callbacks.url, "experiment": args.experiment,
                })
                accepted[answer["id"]] = answer
                sent_at.setdefault(answer["id"], sent)
                how = f"duplicate by {answer['duplicate']}" if answer["duplicate"] else "accepted"
                print(f"update {step:>3}: train return {train_curve[step]:7.1f}  → evaluation "
                      f"{answer['id']} {how} in {1e3 * (time.monotonic() - sent):.0f} ms")
                drain()
            print(f"training done in {time.monotonic() - t0:.0f} s; waiting for "
                  f"{len(set(accepted) - set(reports))} report(s)")
            deadline = time.monotonic() + args.timeout
            while set(accepted) - set(reports) and time.monotonic() < deadline:
                drain(block_s=1.0)
            for eid in sorted(set(accepted) - set(reports)):  # no callback: ask the service
                url = accepted[eid]["status_url"]  # reads are signed too (GET + path)
                status = client.get(url, headers=signed_read_headers(urlsplit(url).path,
                                                                     secret)).json()
                print(f"  no callback for {eid}; status says {status.get('state')}")
                if status.get("report"):
                    reports[eid] = status["report"]
    finally:
        run.finish()
        callbacks.close()
        for env in envs:
            env.close()
        if service is not None:
            print("stopping the service...")
            service.stop()

    done = sorted((r for r in reports.values() if "returns" in r), key=lambda r: r["step"])
    print("\n step  train return  eval return [95% CI]")
    for r in done:
        print(f" {r['step']:>4}  {train_curve[r['step']]:12.1f}  {r['returns']['mean']:11.1f} "
              f"[{r['returns']['ci']['low']:.1f}, {r['returns']['ci']['high']:.1f}]")
    if latency:
        lat = sorted(latency.values())
        print(f"webhook → signed report: median {lat[len(lat) // 2]:.1f} s, max {lat[-1]:.1f} s; "
              f"{callbacks.rejected} callback(s) rejected")
    if args.summary:
        Path(args.summary).write_text(json.dumps({
            "training_run_id": run.run_id, "tracking_uri": tracking_uri,
            "experiment": args.experiment, "train": train_curve,
            "accepted": accepted, "latency_s": latency,
            "evals": [{"step": r["step"], "reward": r["returns"]["mean"],
                       "request_id": r["request_id"],
                       "mlflow_run_id": r["outputs"].get("mlflow_run_id")} for r in done],
        }, indent=2) + "\n")
    return 0 if len(done) == len(accepted) else 1


if __name__ == "__main__":
    raise SystemExit(main())
