"""Reviewing a finished evaluation: failure clustering, episode choice and the report page.

Three pure functions over results, for stage 7 and for people reading results afterwards:

- :func:`cluster_failures` groups failed episodes by end reason and by an error *signature*
  (exception type and raising location, numbers normalised out), so one bug that failed 40
  episodes with 40 different step counts shows up as one row with 40 episodes.
- :func:`choose_episodes` picks the episodes worth replaying for trajectories and videos.
- :func:`report_page` / :func:`report_markdown` render the report as a self-contained HTML page
  (the Jinja2 template ``templates/report.html.j2``, autoescaped; images embedded, so it survives
  being opened from MLflow's artifact store) and as the markdown of the Prefect artifact.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pyarrow as pa

from evalfleet.models import EndReason, EvalReport
from evalfleet.summary import markdown_cell, percent, summary_markdown, summary_rows

__all__ = [
    "choose_episodes",
    "cluster_failures",
    "error_signature",
    "failed_mask",
    "report_markdown",
    "report_page",
]

#: Videos up to this size (bytes, all together) are embedded in the HTML page; larger ones linked.
EMBED_VIDEO_LIMIT = 8 * 1024 * 1024

#: Longest normalised message kept in a signature (error texts are cut at 500 chars upstream,
#: so the tail is unreliable for grouping anyway).
_MAX_MESSAGE = 120

_NO_ERROR = "(no error text)"

# ``Type: message (at file.py:42)`` as written by ``evalfleet.sandbox.base.error_text``. The type
# must look like a Python class name so that prose such as ``killed by signal 11`` is not split.
_TYPED = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*): ?(?P<message>.*)$", re.DOTALL)
_LOCATION = re.compile(r"\s*\(at (?P<location>[^()\s]+:\d+)\)\s*$")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
# A number that is not part of an identifier (``float32``, ``v1``, ``SIGSEGV`` stay as they are).
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w])")
_SPACES = re.compile(r"\s+")


def _normalise_message(message: str) -> str:
    text = _HEX.sub("0x#", message.strip().splitlines()[0] if message.strip() else "")
    text = _SPACES.sub(" ", _NUMBER.sub("#", text))
    return text[:_MAX_MESSAGE]


def error_signature(error: str | None) -> str:
    """A grouping key for an error text: the same bug gives the same signature.

    ``"RuntimeError: boom at step 3 (at myenv.py:42)"`` → ``"RuntimeError at myenv.py:42"``: the
    exception type and the raising location identify the bug; the message is left out because it
    usually carries per-episode values. Texts without a location keep their message with every
    number replaced by ``#`` (``"killed by signal 11 (SIGSEGV)"`` → ``"killed by signal #
    (SIGSEGV)"``; the signal's name keeps distinct signals apart).
    """
    if error is None or not error.strip():
        return _NO_ERROR
    text = error.strip()
    location = _LOCATION.search(text)
    where = location.group("location") if location else None
    if location:
        text = text[: location.start()]
    typed = _TYPED.match(text)
    if typed:
        if where:
            return f"{typed.group('type')} at {where}"
        return f"{typed.group('type')}: {_normalise_message(typed.group('message'))}"
    message = _normalise_message(text)
    return f"{message} at {where}" if where else message


def _is_failure(reason: str) -> bool:
    try:
        return EndReason(reason).is_failure
    except ValueError:  # an unknown reason is not a normal ending either
        return True


def _headline(reason: str) -> str:
    # The rule of evalfleet.scoring, in words for the report page.
    try:
        if EndReason(reason).is_policy_attributable:
            return "counted (the policy's doing: partial return, no success)"
    except ValueError:
        pass
    return "left out (harness failure; lowers coverage)"


def failed_mask(table: pa.Table) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Per-row flag: the episode failed (its end reason is neither terminated nor truncated)."""
    return np.array([_is_failure(r) for r in table.column("end_reason").to_pylist()], dtype=bool)


def cluster_failures(table: pa.Table, max_examples: int = 5) -> list[dict[str, Any]]:
    """Group failed episodes by ``(end_reason, error_signature(error))``.

    Each cluster is a dict with ``reason``, ``signature``, ``count``, ``example_seeds`` and
    ``example_indices`` (the lowest ``max_examples`` episode indices, with their seeds; replaying
    one reproduces the failure), and ``example_error`` (the raw text of the first example).
    Sorted by count, largest first; ties by reason, then signature, so the order is stable.
    """
    if max_examples < 0:
        raise ValueError(f"'max_examples' must be >= 0 (got {max_examples!r}).")
    if table.num_rows == 0:
        return []
    ordered = table.sort_by("episode_index")
    failed = failed_mask(ordered)
    clusters: dict[tuple[str, str], dict[str, Any]] = {}
    columns = ("episode_index", "seed", "end_reason", "error")
    rows = ordered.select(list(columns)).to_pylist()
    for row, is_failed in zip(rows, failed, strict=True):
        if not is_failed:
            continue
        key = (str(row["end_reason"]), error_signature(row["error"]))
        cluster = clusters.get(key)
        if cluster is None:
            cluster = clusters[key] = {
                "reason": key[0],
                "signature": key[1],
                "count": 0,
                "example_seeds": [],
                "example_indices": [],
                "example_error": row["error"],
            }
        cluster["count"] += 1
        if len(cluster["example_indices"]) < max_examples:
            cluster["example_indices"].append(int(row["episode_index"]))
            cluster["example_seeds"].append(int(row["seed"]))
    return sorted(clusters.values(), key=lambda c: (-c["count"], c["reason"], c["signature"]))


def choose_episodes(table: pa.Table, k: int, seed: int) -> list[int]:
    """The episode indices to replay for trajectories or videos, at most ``k``, in priority order.

    1. the worst completed episode (lowest return; ties go to the lowest index),
    2. the best completed episode (highest return; ties go to the lowest index),
    3. every failed episode that ran (a row without a return never started; a ``policy_timeout``
       is not replayable), in index order,
    4. a uniform sample without replacement of the remaining completed episodes, drawn with
       ``np.random.default_rng(seed)`` and listed in index order.

    Each step only adds what is still missing and stops at ``k``, so with few slots the extremes
    win over failures, and failures over the sample. The result depends only on the table's
    contents (not its row order), ``k`` and ``seed``.
    """
    if k <= 0 or table.num_rows == 0:
        return []
    ordered = table.sort_by("episode_index")
    indices = np.asarray(ordered.column("episode_index").to_numpy(), dtype=np.int64)
    returns = np.asarray(ordered.column("return").to_numpy(), dtype=np.float64)
    failed = failed_mask(ordered)
    chosen: list[int] = []

    def add(index: int) -> None:
        if len(chosen) < k and index not in chosen:
            chosen.append(index)

    completed = np.flatnonzero(~failed)
    if completed.size:
        # argmin/argmax return the first extreme, i.e. the lowest index, as rows are index-sorted.
        add(int(indices[completed[np.argmin(returns[completed])]]))
        add(int(indices[completed[np.argmax(returns[completed])]]))
    # Not the never-run (NaN, length 0), nor a policy_timeout: its forward hung, and a replay
    # would hang on it again (``replay.record_episodes`` skips it).
    reasons = np.asarray(ordered.column("end_reason").to_pylist(), dtype=object)
    for index in indices[failed & np.isfinite(returns) & (reasons != EndReason.POLICY_TIMEOUT.value)]:
        add(int(index))
    rest = [int(i) for i in indices[completed] if int(i) not in chosen]
    room = k - len(chosen)
    if room > 0 and rest:
        rng = np.random.default_rng(seed)
        sample = rng.choice(len(rest), size=min(room, len(rest)), replace=False)
        chosen.extend(sorted(rest[i] for i in sample))
    return chosen


# ---------------------------------------------------------------------------------------------
# Report page and markdown


_md = markdown_cell  # error texts are user data


def _md_code(text: object) -> str:
    # Inside a code span markdown shows text literally (no HTML), so only the delimiters matter.
    return "`" + str(text).replace("`", "'").replace("|", "/").replace("\n", " ") + "`"


def _examples(cluster: Mapping[str, Any]) -> str:
    pairs = zip(cluster["example_indices"], cluster["example_seeds"], strict=True)
    return ", ".join(f"#{i} (seed {s})" for i, s in pairs)


def report_markdown(report: EvalReport, clusters: Sequence[Mapping[str, Any]]) -> str:
    """The report as markdown for the Prefect artifact: summary, alarms and failure taxonomy."""
    parts = [summary_markdown(report)]
    if report.alarms:
        parts.append("## Alarms\n\n" + "\n".join(f"- **{_md(a)}**" for a in report.alarms) + "\n")
    parts.append("## Failure taxonomy\n")
    if not clusters:
        parts.append("No failed episodes.\n")
    else:
        lines = [
            "| reason | signature | episodes | examples (index, seed) | example error |",
            "|---|---|---:|---|---|",
        ]
        for c in clusters:
            error = _md(c["example_error"] or "")[:200]
            lines.append(
                f"| {_md(c['reason'])} | {_md_code(c['signature'])} | {c['count']} | "
                f"{_examples(c)} | {error} |"
            )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


#: Captions of the plots written by ``evalfleet.plots.render_plots``, by key.
_CAPTIONS = {
    "returns": "Returns of the scored episodes (completed, and ended by the policy with their "
    "partial return), with the mean and its 95% confidence interval.",
    "lengths": "Episode lengths in env steps; failed episodes stacked on top in red.",
    "return_by_episode": "Return by episode index; failures marked with an x at their "
    "partial return (red: ended by the policy, counted; grey: harness failure, left out). "
    "Patterns along the index point at seed-dependent behaviour.",
    "actions": "Actions taken in the replayed episodes.",
    "ci_rounds": "Adaptive evaluation: CI half-width after each round.",
}


def _data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _relative(path: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive on Windows: fall back to the file name
        return path.name


def _videos(videos: Mapping[int, Path], start: Path) -> list[dict[str, Any]]:
    """Template rows of the videos: embedded while the total stays under the limit, else linked."""
    items, embedded = [], 0
    for index, path in sorted(videos.items()):
        path = Path(path)
        size = path.stat().st_size if path.exists() else 0
        embed = 0 < size and embedded + size <= EMBED_VIDEO_LIMIT
        if embed:
            embedded += size
        gif = path.suffix.lower() == ".gif"
        src = _data_uri(path, "image/gif" if gif else "video/mp4") if embed else _relative(path, start)
        items.append({"index": index, "name": path.name, "gif": gif, "src": src})
    return items


@functools.cache
def _templates() -> jinja2.Environment:
    # Autoescape everything: env ids, error texts and the manifest are user data.
    return jinja2.Environment(
        loader=jinja2.PackageLoader("evalfleet", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )


def report_page(
    report: EvalReport,
    clusters: Sequence[Mapping[str, Any]],
    plots: Mapping[str, Path],
    out_path: Path,
    *,
    videos: Mapping[int, Path] | None = None,
    notes: Sequence[str] = (),
) -> Path:
    """Write a self-contained HTML report to ``out_path`` and return the path.

    Plots (PNG) are embedded as base64 so the page reads the same from disk, from MLflow's
    artifact view or as an e-mail attachment. ``videos`` (episode index → GIF/MP4) are embedded
    while their total size stays under ``EMBED_VIDEO_LIMIT``, and otherwise linked relative to
    the page (keep them next to it). ``notes`` are extra findings shown under the alarms, e.g.
    replay mismatches (``ReplayResult.notes()``).
    """
    out_path = Path(out_path)
    failures = [
        {"reason": reason, "count": count, "share": percent(count / max(report.episodes, 1)),
         "headline": _headline(reason)}
        for reason, count in sorted(report.failures.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    taxonomy = [
        {"reason": str(c["reason"]), "signature": str(c["signature"]), "count": c["count"],
         "examples": _examples(c), "example_error": str(c["example_error"] or "")}
        for c in clusters
    ]
    figures = [
        {"key": key, "caption": _CAPTIONS.get(key, key), "src": _data_uri(Path(path), "image/png")}
        for key, path in plots.items()
    ]
    page = _templates().get_template("report.html.j2").render(
        title=f"evalfleet report — {report.env_id}",
        report=report,
        notes=list(notes),
        summary=summary_rows(report),
        failures=failures,
        clusters=taxonomy,
        plots=figures,
        videos=_videos(videos or {}, out_path.parent),
        manifest=json.dumps(report.manifest, indent=2, sort_keys=True, default=str),
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out_path)  # readers never see half a page
    return out_path
