"""Entry point of ``python -m deployments.webhook``."""

from deployments.webhook.cli import main

raise SystemExit(main())
