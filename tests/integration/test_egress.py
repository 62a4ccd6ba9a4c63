"""The egress policy: which URLs a request may make the service reach (issue 14, item 6).

Refusals of non-loopback targets are asserted on the parsed and resolved URL, before any
connection: literal addresses, and a resolver that answers from a table (no name is looked up).
Everything that does connect talks to servers on 127.0.0.1 that the policy allows explicitly.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pytest

from evalfleet.callback import post_report
from evalfleet.egress import (
    AllowEntry,
    DownloadError,
    EgressPolicy,
    EgressRefused,
    download,
)

from .conftest import CALLBACK_SECRET, TrainerEndpoint


def fake_dns(table: dict[str, list[str]]) -> Any:
    """A resolver answering from ``table``; it records what it was asked."""
    asked: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    resolve.asked = asked  # type: ignore[attr-defined]
    return resolve


@pytest.mark.parametrize(
    ("url", "category"),
    [
        ("https://10.0.0.1/p.pt", "private"),
        ("https://172.16.5.4/p.pt", "private"),
        ("https://192.168.1.1/p.pt", "private"),
        ("https://[fc00::1]/p.pt", "private"),
        ("https://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("https://[fd00:ec2::254]/", "cloud metadata"),
        ("https://169.254.10.10/", "link-local"),
        ("https://[fe80::1]/", "link-local"),
        ("https://127.0.0.1:8080/", "loopback"),
        ("https://[::1]/", "loopback"),
        ("https://0.0.0.0/", "unspecified"),
        ("https://[::]/", "unspecified"),
        ("https://224.0.0.1/", "multicast"),
        ("https://[ff02::1]/", "multicast"),
        ("https://100.64.0.1/", "reserved"),
        ("https://[::ffff:10.0.0.1]/", "private"),  # IPv4-mapped: judged as 10.0.0.1
    ],
)
def test_non_public_addresses_are_refused(url: str, category: str) -> None:
    with pytest.raises(EgressRefused, match=f"is a {category} address"):
        EgressPolicy().check(url)


def test_names_are_resolved_once_and_every_address_checked() -> None:
    dns = fake_dns({"metadata.google.internal": ["169.254.169.254"],
                    "mixed.example": ["93.184.216.34", "10.1.2.3"],
                    "public.example": ["93.184.216.34"], "localhost": ["127.0.0.1"]})
    policy = EgressPolicy(resolver=dns)
    with pytest.raises(EgressRefused, match=r"'metadata.google.internal' \(169.254.169.254\) "
                       "is a cloud metadata"):
        policy.check("http://metadata.google.internal/computeMetadata/v1/")
    with pytest.raises(EgressRefused, match=r"\(10.1.2.3\) is a private address"):
        policy.check("https://mixed.example/p.pt")  # one bad address is enough
    with pytest.raises(EgressRefused, match="loopback"):
        policy.check("https://localhost/p.pt")
    target = policy.check("https://public.example/a/p.pt?v=1")
    assert dns.asked.count("public.example") == 1
    # Pinned: the connection goes to the checked address, the name rides in Host and SNI.
    assert target.pinned_url == "https://93.184.216.34:443/a/p.pt?v=1"
    assert target.host_header == "public.example" and target.address == "93.184.216.34"
    with pytest.raises(EgressRefused, match="http:// is allowed only to allow-listed hosts"):
        policy.check("http://public.example/p.pt")
    with pytest.raises(EgressRefused, match="cannot resolve 'nowhere.example'"):
        policy.check("https://nowhere.example/")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://93.184.216.34/p.pt", "scheme 'ftp' is not allowed"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("gopher://93.184.216.34/", "scheme 'gopher'"),
        ("https://user:pw@93.184.216.34/", "credentials in URLs"),
        ("https:///nohost", "has no host"),
        ("https://93.184.216.34:99999/", "not a valid URL"),
        ("not a url", "scheme '' is not allowed"),
    ],
)
def test_malformed_or_other_schemes_are_refused(url: str, reason: str) -> None:
    with pytest.raises(EgressRefused, match=reason):
        EgressPolicy().check(url)


def test_allow_list_entries() -> None:
    dns = fake_dns({"models.internal": ["10.2.3.4"], "rebind.example": ["10.9.9.9"]})
    policy = EgressPolicy.parse(["models.internal", "127.0.0.1:8080", "10.5.0.0/16", "[::1]",
                                 "169.254.0.0/16"], public=True)
    policy = EgressPolicy(policy.allowed, policy.public, resolver=dns)
    assert policy.check("http://models.internal/p.pt").address == "10.2.3.4"
    assert policy.check("http://127.0.0.1:8080/cb").port == 8080
    with pytest.raises(EgressRefused, match="loopback"):
        policy.check("http://127.0.0.1:8081/cb")  # another port of an allowed address
    assert policy.check("http://10.5.7.7/p.pt").address == "10.5.7.7"
    with pytest.raises(EgressRefused, match="private"):
        policy.check("https://rebind.example/")  # a public-looking name with a private answer
    assert policy.check("http://[::1]:9000/").address == "::1"
    # A broad link-local entry does not open the metadata address: only an exact entry does.
    assert policy.check("http://169.254.1.1/").address == "169.254.1.1"
    with pytest.raises(EgressRefused, match="cloud metadata"):
        policy.check("http://169.254.169.254/")
    exact = EgressPolicy.parse("169.254.169.254:80")
    assert exact.check("http://169.254.169.254/").address == "169.254.169.254"
    # Allow-list only: unlisted public hosts are refused too.
    strict = EgressPolicy.parse("127.0.0.1", public=False)
    with pytest.raises(EgressRefused, match="not on the allow-list"):
        strict.check("https://93.184.216.34/")
    assert EgressPolicy.from_env({"EVALFLEET_ALLOWED_HOSTS": "127.0.0.1:1, localhost",
                                  "EVALFLEET_EGRESS_PUBLIC": "0"}) == EgressPolicy(
        (AllowEntry(None, AllowEntry.parse("127.0.0.1").network, 1),
         AllowEntry("localhost", None, None)), public=False)
    for bad in ("http://x", "a b", "host:port", "[::1]:0", "u@h"):
        with pytest.raises(EgressRefused, match="allow-list entry"):
            EgressPolicy.parse(bad)


def test_download_streams_hashes_and_caps(loopback_server: Any) -> None:
    blob = bytes(range(256)) * 400  # 102,400 bytes
    sha = hashlib.sha256(blob).hexdigest()
    other = loopback_server({"/p.pt": (200, {}, b"never fetched")})
    server = loopback_server({
        "/p.pt": (200, {}, blob),
        "/big": (200, {"Content-Length": "omit"}, blob),  # no length: the cap stops the stream
        "/declared": (200, {"Content-Length": str(10**9)}, b"x"),
        "/hop": (302, {"Location": "/p.pt"}, b""),
        "/away": (302, {"Location": f"{other.url}/p.pt"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    })
    port = server.url.rsplit(":", 1)[1]
    policy = EgressPolicy.parse([f"127.0.0.1:{port}"], public=False)
    sink = io.BytesIO()
    assert download(f"{server.url}/hop", policy, sink, max_bytes=len(blob),
                    expected_sha256=sha) == (sha, len(blob))
    assert sink.getvalue() == blob
    sink = io.BytesIO()
    with pytest.raises(DownloadError, match="more than the 50000 bytes allowed; download stopped"):
        download(f"{server.url}/big", policy, sink, max_bytes=50_000)
    assert len(sink.getvalue()) <= 50_000
    with pytest.raises(DownloadError, match="is 1000000000 bytes, more than the 50000"):
        download(f"{server.url}/declared", policy, io.BytesIO(), max_bytes=50_000)
    with pytest.raises(DownloadError, match=f"sha256 of the bytes at .* is {sha}, not 0000"):
        download(f"{server.url}/p.pt", policy, io.BytesIO(), max_bytes=len(blob),
                 expected_sha256="0" * 64)
    # A redirect to a loopback port the allow-list does not name: refused, nothing sent there.
    with pytest.raises(EgressRefused, match="loopback"):
        download(f"{server.url}/away", policy, io.BytesIO(), max_bytes=len(blob))
    assert other.requests == []
    with pytest.raises(DownloadError, match="redirected more than 5 times"):
        download(f"{server.url}/loop", policy, io.BytesIO(), max_bytes=len(blob))
    assert server.requests.count("GET /loop") == 6


def test_callback_to_a_refused_url_sends_nothing(trainer: TrainerEndpoint) -> None:
    port = trainer.url.split(":")[2].split("/")[0]
    elsewhere = EgressPolicy.parse(["127.0.0.1:1"])  # loopback, but not the trainer's port
    result = post_report(trainer.url, {"request_id": "r9"}, CALLBACK_SECRET, egress=elsewhere)
    assert not result.delivered and result.attempts == 0
    assert (result.error or "").startswith("refused: '127.0.0.1' is a loopback address")
    assert trainer.calls == []
    result = post_report("http://169.254.169.254/latest", {"request_id": "r10"}, "k",
                         egress=EgressPolicy())
    assert result.attempts == 0 and "cloud metadata" in (result.error or "")
    allowed = EgressPolicy.parse([f"127.0.0.1:{port}"], public=False)
    assert post_report(trainer.url, {"request_id": "r11"}, CALLBACK_SECRET,
                       egress=allowed).delivered
    assert trainer.next(timeout=10)["report"] == {"request_id": "r11"}
