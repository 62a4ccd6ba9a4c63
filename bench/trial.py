"""One trial in a fresh process: ``python -m bench.trial '<json spec>'`` (from the repository root).

Runs one contender (``spec["contender"]``) inside a measured window and prints one line
``BENCH-RESULT <json>`` (a list of results for contenders that measure several runs themselves).
A fresh process per trial keeps imports, start methods and memory of one contender away from
the next.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

MARK = "BENCH-RESULT "


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("EVALFLEET_DASHBOARD", "")
    if spec.get("api_url"):
        os.environ["PREFECT_API_URL"] = spec["api_url"]
    t_import = time.perf_counter()
    from bench.contenders import CONTENDERS, preimport
    from bench.measure import window

    fn = CONTENDERS[spec["contender"]]
    result: object
    try:
        preimport(spec["contender"])
        imports_s = time.perf_counter() - t_import
        if spec["contender"] == "evalfleet_flow":
            result = fn(spec)
        else:
            with window() as w:
                out = fn(spec)
            result = {"ok": True, "wall_s": w.wall_s, "cpu_s": w.cpu_s, "peak_rss": w.peak_rss,
                      "imports_s": imports_s, **out}
    except Exception as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                  "traceback": traceback.format_exc()[-3000:]}
    sys.stdout.write("\n" + MARK + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
