"""``python -m evalfleet.cli`` runs nothing: it says so and exits 2, never 0 with nothing done."""

import subprocess
import sys


def test_running_the_parser_module_is_refused_with_where_to_go() -> None:
    done = subprocess.run([sys.executable, "-m", "evalfleet.cli", "--episodes", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "runs nothing" in done.stderr and "'evalfleet eval ...'" in done.stderr
    assert "python flows/eval.py" in done.stderr and done.stdout == ""
