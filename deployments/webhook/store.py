"""The receiver's memory of its answers: delivery ids and cache keys → evaluations, in SQLite."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The evaluation id of a reserved delivery whose evaluation is not created yet.
PENDING = ""


@dataclass(frozen=True)
class Evaluation:
    """One row of the store: an evaluation and the flow run doing it."""

    id: str
    cache_key: str
    flow_run_id: str
    request: dict[str, Any]
    created_at: float


class EvaluationStore:
    """Delivery ids and cache keys → evaluations, in SQLite: this receiver's memory of answers.

    Not what keeps runs unique: Prefect's idempotency keys do that across receivers. The store
    answers repeated deliveries without a round trip and detects a delivery id reused for a
    different body: a delivery id is reserved (``reserve``) before its policy is fetched or its
    flow run created, so of two deliveries of one id handled at once, one goes on and the
    other gets the answer it would get after it.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._lock = threading.Lock()  # one connection, shared by the threadpool
        with self._lock:
            self._db.executescript(
                """
                CREATE TABLE IF NOT EXISTS evaluations (
                    id TEXT PRIMARY KEY, cache_key TEXT NOT NULL, flow_run_id TEXT NOT NULL,
                    request TEXT NOT NULL, created_at REAL NOT NULL);
                CREATE INDEX IF NOT EXISTS evaluations_by_key ON evaluations (cache_key);
                CREATE TABLE IF NOT EXISTS deliveries (
                    delivery_id TEXT PRIMARY KEY, evaluation_id TEXT NOT NULL,
                    body_sha256 TEXT NOT NULL, received_at REAL NOT NULL);
                """
            )

    def delivery(self, delivery_id: str) -> tuple[str, str] | None:
        """(evaluation id, body sha256) of a known delivery."""
        with self._lock:
            row = self._db.execute(
                "SELECT evaluation_id, body_sha256 FROM deliveries WHERE delivery_id = ?",
                (delivery_id,),
            ).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def by_cache_key(self, key: str) -> list[Evaluation]:
        """Evaluations with this cache key, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, cache_key, flow_run_id, request, created_at FROM evaluations "
                "WHERE cache_key = ? ORDER BY created_at DESC", (key,),
            ).fetchall()
        return [Evaluation(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    def get(self, evaluation_id: str) -> Evaluation | None:
        """The evaluation with this id."""
        with self._lock:
            r = self._db.execute(
                "SELECT id, cache_key, flow_run_id, request, created_at FROM evaluations "
                "WHERE id = ?", (evaluation_id,),
            ).fetchone()
        return Evaluation(r[0], r[1], r[2], json.loads(r[3]), r[4]) if r else None

    def reserve(self, delivery_id: str, body_sha256: str) -> tuple[str, str] | None:
        """Reserve ``delivery_id`` for this body (insert, failing on conflict); None when reserved now.

        Otherwise (evaluation id, body sha256) of the delivery holding it; its evaluation id is
        ``PENDING`` while that delivery is being handled (its policy fetched, its run created).
        Checked, then recorded after the flow run was created, one delivery id sent with two
        bodies at once got two 202s and two flow runs.
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # receivers may share the state dir
            try:
                try:
                    self._db.execute("INSERT INTO deliveries VALUES (?, ?, ?, ?)",
                                     (delivery_id, PENDING, body_sha256, time.time()))
                    row = None
                except sqlite3.IntegrityError:  # held: by whom, read in the same transaction
                    row = self._db.execute(
                        "SELECT evaluation_id, body_sha256 FROM deliveries WHERE delivery_id = ?",
                        (delivery_id,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return (str(row[0]), str(row[1])) if row else None

    def release(self, delivery_id: str, body_sha256: str) -> None:
        """Drop this body's reservation of ``delivery_id`` unless it was recorded: a retry may go on."""
        with self._lock:
            self._db.execute("DELETE FROM deliveries WHERE delivery_id = ? AND body_sha256 = ? "
                             "AND evaluation_id = ?", (delivery_id, body_sha256, PENDING))

    def record(self, delivery_id: str, body_sha256: str, evaluation: Evaluation | None,
               evaluation_id: str) -> None:
        """Insert the delivery (and the evaluation if new) in one transaction.

        A reservation of the delivery id for this body gets the evaluation id; one for another
        body, or a delivery recorded already, is kept.
        """
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if evaluation is not None:
                    self._db.execute(
                        "INSERT OR IGNORE INTO evaluations VALUES (?, ?, ?, ?, ?)",
                        (evaluation.id, evaluation.cache_key, evaluation.flow_run_id,
                         json.dumps(evaluation.request), evaluation.created_at),
                    )
                self._db.execute(
                    "INSERT INTO deliveries VALUES (?, ?, ?, ?) ON CONFLICT (delivery_id) DO UPDATE "
                    "SET evaluation_id = excluded.evaluation_id WHERE deliveries.evaluation_id = ? "
                    "AND deliveries.body_sha256 = excluded.body_sha256",
                    (delivery_id, evaluation_id, body_sha256, now, PENDING))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def ping(self) -> bool:
        """True when the database answers."""
        with self._lock:
            return bool(self._db.execute("SELECT 1").fetchone() == (1,))

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()
