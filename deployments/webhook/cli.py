"""``python -m deployments.webhook``: options, configuration from them, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from deployments import (
    DEPLOYMENT,
    WEBHOOK_PREVIOUS_SECRET_ENV,
    WEBHOOK_SECRET_ENV,
    resolve_secret,
)
from deployments.webhook.app import create_app
from deployments.webhook.receiver import ReceiverConfig, check_service_settings
from evalfleet.egress import (
    ALLOWED_HOSTS_ENV,
    DEFAULT_MAX_DOWNLOAD_BYTES,
    PUBLIC_ENV,
    EgressPolicy,
    EgressRefused,
)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m deployments.webhook``."""
    p = argparse.ArgumentParser(
        prog="python -m deployments.webhook",
        description=f"Webhook receiver in front of Prefect. Secret: ${WEBHOOK_SECRET_ENV} (and "
        f"${WEBHOOK_PREVIOUS_SECRET_ENV} during a rotation) or --secret-block.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--prefect-api-url", default=os.environ.get("PREFECT_API_URL"),
                   help="Prefect API (default: $PREFECT_API_URL)")
    p.add_argument("--deployment", default=DEPLOYMENT, help="flow-name/deployment-name to trigger")
    p.add_argument("--state-dir", default=".evalfleet", help="SQLite store and policy copies")
    p.add_argument("--output", default="results", help="results folder of the evaluations")
    p.add_argument("--mlflow-uri", default=None, help="MLflow URI (default under --output)")
    p.add_argument("--experiment", default="evalfleet", help="default MLflow experiment")
    p.add_argument("--isolation", default="auto", help="inprocess | process | bwrap | auto")
    p.add_argument("--secret-block", default=None, help="Prefect Secret block with the secret")
    add_egress_options(p)
    p.add_argument("--log-level", default="info")
    return p


def add_egress_options(p: argparse.ArgumentParser) -> None:
    """``--allow-host``, ``--no-public-egress`` and ``--max-policy-bytes`` (receiver and serve)."""
    p.add_argument("--allow-host", action="append", default=None, metavar="HOST[:PORT]|CIDR",
                   help=f"host, address or network that policy.uri / callback_url may reach even "
                   f"if private or loopback, and over http (repeatable; default "
                   f"${ALLOWED_HOSTS_ENV})")
    p.add_argument("--no-public-egress", action="store_true",
                   help=f"reach only allow-listed hosts (default: also public https; "
                   f"${PUBLIC_ENV}=0 does the same)")
    p.add_argument("--max-policy-bytes", type=int, default=DEFAULT_MAX_DOWNLOAD_BYTES,
                   help="largest policy file accepted; downloads stop there")
    p.add_argument("--policy-root", action="append", default=[], metavar="DIR",
                   help="folder file:// policy URIs must lie under (repeatable; default: any)")


def egress_from_args(args: argparse.Namespace) -> EgressPolicy:
    """The egress policy of parsed options, falling back to the environment."""
    env = EgressPolicy.from_env()
    hosts = args.allow_host if args.allow_host is not None else [
        e for e in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if e.strip()]
    try:
        return EgressPolicy.parse(hosts, public=env.public and not args.no_public_egress)
    except EgressRefused as err:
        raise SystemExit(f"evalfleet webhook: {err}") from None


def config_from_args(args: argparse.Namespace) -> ReceiverConfig:
    """A ``ReceiverConfig`` from parsed options and the environment."""
    if not args.prefect_api_url:
        raise SystemExit("evalfleet webhook: no Prefect API; pass --prefect-api-url or set "
                         "PREFECT_API_URL (the receiver never starts a temporary server).")
    check_service_settings(isolation=args.isolation, output=Path(args.output).resolve(),
                           mlflow_uri=args.mlflow_uri, experiment=args.experiment)
    os.environ["PREFECT_API_URL"] = args.prefect_api_url  # for a Secret block lookup
    secrets = tuple(s for s in (resolve_secret(WEBHOOK_SECRET_ENV, args.secret_block),
                                os.environ.get(WEBHOOK_PREVIOUS_SECRET_ENV, "")) if s)
    return ReceiverConfig(
        secrets=secrets, prefect_api_url=args.prefect_api_url, state_dir=Path(args.state_dir),
        output=Path(args.output).resolve(), deployment=args.deployment,
        mlflow_uri=args.mlflow_uri, experiment=args.experiment, isolation=args.isolation,
        max_policy_bytes=args.max_policy_bytes, egress=egress_from_args(args),
        policy_roots=tuple(Path(r).resolve() for r in args.policy_root),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the receiver with uvicorn until interrupted."""
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0

