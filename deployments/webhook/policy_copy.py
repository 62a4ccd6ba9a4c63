"""Copy a policy named by a webhook into the content-addressed folder the flow run loads from.

The bytes are hashed while they stream, so the file a flow run loads is exactly the one the
trainer hashed; http(s) goes through the egress policy, ``file://`` through the allowed roots.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from deployments.webhook.schema import PolicyRef, Rejected
from evalfleet.egress import DownloadError, EgressPolicy, EgressRefused, download


def fetch_policy(ref: PolicyRef, folder: Path, max_bytes: int,
                 egress: EgressPolicy | None = None, roots: tuple[Path, ...] = ()) -> Path:
    """Copy the policy at ``ref.uri`` into ``folder/<sha256>.pt``, hashing while it streams.

    http(s) URIs go through ``egress`` (default: public https only): the host is resolved once
    and checked, each redirect hop too, and the transfer stops past ``max_bytes``. Nothing lands
    under its final name unless the sha256 matches ``ref.sha256``. File URIs must lie under one
    of ``roots`` when any are given.
    """
    parts = urlsplit(ref.uri)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as sink:
            if parts.scheme in ("", "file"):
                digest = _copy_file(ref.uri, parts.path if parts.scheme else ref.uri, sink,
                                    max_bytes, roots)
            elif parts.scheme in ("http", "https"):
                try:
                    digest, _ = download(ref.uri, egress or EgressPolicy(), sink,
                                         max_bytes=max_bytes)
                except (EgressRefused, DownloadError) as err:
                    raise Rejected(400, "invalid_request", f"policy.uri refused: {err}",
                                   field_name="policy.uri") from None
            else:
                raise Rejected(400, "invalid_request", f"unsupported URI scheme "
                               f"{parts.scheme!r}; use file:// (storage shared with the "
                               "service) or http(s)://", field_name="policy.uri")
        if digest != ref.sha256:
            raise Rejected(400, "invalid_request", f"sha256 of the bytes at policy.uri is "
                           f"{digest}, not {ref.sha256}: the file changed or the hash is wrong",
                           field_name="policy.sha256")
        dest = folder / f"{digest}.pt"
        os.replace(tmp, dest)  # concurrent writers of the same hash write the same bytes
        return dest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copy_file(uri: str, raw_path: str, sink: Any, max_bytes: int,
               roots: tuple[Path, ...]) -> str:
    path = Path(unquote(raw_path))
    if not path.is_absolute():
        raise Rejected(400, "invalid_request", f"a file policy URI must be absolute (got "
                       f"{uri!r})", field_name="policy.uri")
    real = path.resolve()  # a symlink or '..' must not lead out of the roots
    if roots and not any(real.is_relative_to(root.resolve()) for root in roots):
        raise Rejected(400, "invalid_request", f"{str(path)!r} is outside the folders file "
                       f"policy URIs may name ({', '.join(str(r) for r in roots)}); put the "
                       "policy there or send an https:// URI", field_name="policy.uri")
    digest, size = hashlib.sha256(), 0
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise Rejected(400, "invalid_request", f"policy is more than the "
                                   f"{max_bytes} bytes allowed", field_name="policy.uri")
                digest.update(chunk)
                sink.write(chunk)
    except OSError as err:
        raise Rejected(400, "invalid_request", f"cannot read {str(path)!r}: "
                       f"{err.strerror or err}", field_name="policy.uri") from None
    return digest.hexdigest()
