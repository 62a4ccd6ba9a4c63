"""Outbound HTTP that a request can steer: policy downloads and report callbacks.

A signed sender chooses ``policy.uri`` and ``callback_url``; without checks they would make the
service reach any host its network can (cloud metadata, the Prefect API, a database on the
private network). Every such URL goes through an ``EgressPolicy``:

- schemes: ``https``; ``http`` only to allow-listed hosts;
- the host name is resolved ONCE, every address it resolves to is checked, and the connection
  goes to the checked address (the URL is rewritten to the IP; ``Host`` header and TLS SNI keep
  the name, so certificates are still verified against it). A DNS answer that changes between
  check and connect (rebinding) cannot move the request;
- refused unless allow-listed: loopback, link-local (169.254/16, fe80::/10), private (10/8,
  172.16/12, 192.168/16, fc00::/7), shared (100.64/10), unspecified, multicast, reserved and
  documentation addresses; cloud metadata addresses (169.254.169.254, fd00:ec2::254,
  100.100.100.200) only by an entry naming that exact address;
- redirects are followed by hand, each hop checked the same way, at most ``MAX_REDIRECTS``;
- downloads stop at a size cap and hash while streaming.

The allow-list comes from ``$EVALFLEET_ALLOWED_HOSTS`` (comma-separated; ``evalfleet serve
--allow-host`` sets it for every component). An entry is a host name (``models.internal``), an
address or network (``10.1.2.3``, ``10.0.0.0/8``, ``[::1]``), each optionally with a port
(``127.0.0.1:8080``, ``[::1]:9000``, ``models.internal:443``). ``$EVALFLEET_EGRESS_PUBLIC=0``
refuses public hosts that are not listed (allow-list only).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

import httpx

from evalfleet.errors import EvalfleetError

ALLOWED_HOSTS_ENV = "EVALFLEET_ALLOWED_HOSTS"
PUBLIC_ENV = "EVALFLEET_EGRESS_PUBLIC"
MAX_REDIRECTS = 5
#: Default cap of a policy download: larger than any policy this service evaluates (an MLP is
#: kilobytes, a large vision policy a few hundred MB), small enough to bound disk and time.
DEFAULT_MAX_DOWNLOAD_BYTES = 512 * 1024**2
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
_REDIRECTS = (301, 302, 303, 307, 308)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]


class EgressRefused(EvalfleetError):
    """A URL the service was asked to reach is not allowed; nothing was sent to it."""


class DownloadError(EvalfleetError):
    """A download failed, was larger than allowed, or its bytes do not hash as promised."""


def _system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _category(addr: IPAddress) -> str | None:
    """Why an address is not public (None when it is a plain public address)."""
    if addr in METADATA_ADDRESSES:
        return "cloud metadata"
    for name, test in (("unspecified", addr.is_unspecified), ("loopback", addr.is_loopback),
                       ("link-local", addr.is_link_local), ("multicast", addr.is_multicast)):
        if test:
            return name
    if addr.is_private:
        return "private"
    if not addr.is_global or addr.is_reserved:
        return "reserved"
    return None


def _plain(addr: IPAddress) -> IPAddress:
    # ::ffff:10.0.0.1 reaches 10.0.0.1: judge it as the IPv4 address it is.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True)
class AllowEntry:
    """One allow-list entry: a host name or a network, optionally one port."""

    host: str | None
    """Lower-case host name, when the entry names one."""
    network: IPNetwork | None
    """Address or network, when the entry is one."""
    port: int | None
    """The only port allowed; None = any."""

    @classmethod
    def parse(cls, text: str) -> AllowEntry:
        """``name``, ``name:port``, ``1.2.3.4[:port]``, ``10.0.0.0/8``, ``[::1][:port]``, ``fd00::/8``."""
        raw = text.strip()
        if not raw or "://" in raw or "@" in raw:
            raise EgressRefused(f"allow-list entry must be 'host', 'host:port', an address or a "
                                f"network (got {text!r})")
        port: int | None = None
        if raw.startswith("["):
            inner, _, rest = raw[1:].partition("]")
            if rest:
                port = cls._port(rest.removeprefix(":"), text)
            raw = inner
        elif raw.count(":") == 1:
            raw, _, port_text = raw.partition(":")
            port = cls._port(port_text, text)
        try:
            return cls(None, ipaddress.ip_network(raw, strict=False), port)
        except ValueError:
            pass
        if not all(part and all(c.isalnum() or c in "-_" for c in part)
                   for part in raw.lower().rstrip(".").split(".")):
            raise EgressRefused(f"allow-list entry {text!r} is neither a host name nor an "
                                "address/network")
        return cls(raw.lower().rstrip("."), None, port)

    @staticmethod
    def _port(value: str, text: str) -> int:
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise EgressRefused(f"allow-list entry {text!r} has an invalid port {value!r}")
        return int(value)

    def matches_name(self, host: str, port: int) -> bool:
        """True when this entry names ``host`` (and allows ``port``)."""
        return self.host is not None and self.host == host and self.port in (None, port)

    def matches_address(self, addr: IPAddress, port: int) -> bool:
        """True when ``addr`` is in this entry's network (and ``port`` is allowed).

        Metadata addresses need an entry naming exactly them: a broad ``169.254.0.0/16`` entry
        (or a link-local name) does not open them.
        """
        if self.network is None or self.port not in (None, port):
            return False
        if addr in METADATA_ADDRESSES:
            return self.network.num_addresses == 1 and addr in self.network
        return addr in self.network


@dataclass(frozen=True)
class Target:
    """A checked URL and the address the connection must go to."""

    url: str
    """The URL as asked (for messages and for resolving relative redirects)."""
    scheme: str
    host: str
    port: int
    address: str
    """The checked IP address the request is pinned to."""

    @property
    def pinned_url(self) -> str:
        """The URL with the host replaced by the checked address."""
        parts = urlsplit(self.url)
        ip = f"[{self.address}]" if ":" in self.address else self.address
        path = parts.path or "/"
        return f"{self.scheme}://{ip}:{self.port}{path}" + (f"?{parts.query}" if parts.query else "")

    @property
    def host_header(self) -> str:
        """``Host`` as the name-based URL would have sent it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    def request(self, client: httpx.Client, method: str, *, content: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> httpx.Request:
        """A request to the pinned address, carrying the name in ``Host`` and TLS SNI."""
        merged = {**(headers or {}), "Host": self.host_header}
        extensions = {}
        if self.scheme == "https":
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                extensions["sni_hostname"] = self.host
        return client.build_request(method, self.pinned_url, content=content, headers=merged,
                                    extensions=extensions)


@dataclass(frozen=True)
class EgressPolicy:
    """Which outbound URLs a request may make the service reach (see the module docstring)."""

    allowed: tuple[AllowEntry, ...] = ()
    """Hosts, addresses and networks allowed even when not public, and over http."""
    public: bool = True
    """Allow https to public addresses that no entry lists."""
    resolver: Resolver = field(default=_system_resolver, compare=False, repr=False)
    """Host name → addresses (tests pass a fake one so no name is ever looked up)."""

    @classmethod
    def parse(cls, entries: Iterable[str] | str, *, public: bool = True) -> EgressPolicy:
        """A policy from entries (or one comma-separated string)."""
        items = entries.split(",") if isinstance(entries, str) else list(entries)
        return cls(tuple(AllowEntry.parse(e) for e in items if e.strip()), public)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EgressPolicy:
        """``$EVALFLEET_ALLOWED_HOSTS`` and ``$EVALFLEET_EGRESS_PUBLIC`` (default: public https only)."""
        env = os.environ if environ is None else environ
        public = env.get(PUBLIC_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        return cls.parse(env.get(ALLOWED_HOSTS_ENV, ""), public=public)

    def check(self, url: str) -> Target:
        """Parse, resolve once and check ``url``; raises ``EgressRefused`` saying why."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as err:
            raise EgressRefused(f"{url!r} is not a valid URL: {err}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise EgressRefused(f"scheme {parts.scheme!r} is not allowed (use https://) in {url!r}")
        if parts.username is not None or parts.password is not None:
            raise EgressRefused(f"credentials in URLs are not accepted ({parts.hostname!r})")
        host = (parts.hostname or "").rstrip(".")
        if not host:
            raise EgressRefused(f"{url!r} has no host")
        port = port or (443 if scheme == "https" else 80)
        by_name = any(e.matches_name(host, port) for e in self.allowed)
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = self.resolver(host, port)
            except (OSError, UnicodeError) as err:
                raise EgressRefused(f"cannot resolve {host!r}: {err}") from None
            if not addresses:
                raise EgressRefused(f"{host!r} resolves to no address")
        for text in addresses:
            addr = _plain(ipaddress.ip_address(text.split("%")[0]))
            listed = any(e.matches_address(addr, port) for e in self.allowed)
            category = _category(addr)
            if listed or (by_name and addr not in METADATA_ADDRESSES):
                continue
            where = f"{host!r}" + (f" ({addr})" if literal is None else "")
            if category is not None:
                raise EgressRefused(
                    f"{where} is a {category} address, which requests may not reach; an operator "
                    f"can allow it with {ALLOWED_HOSTS_ENV} / --allow-host")
            if not self.public:
                raise EgressRefused(f"{where} is not on the allow-list ({ALLOWED_HOSTS_ENV} / "
                                    "--allow-host) and public hosts are off")
            if scheme != "https":
                raise EgressRefused(f"http:// is allowed only to allow-listed hosts; use https:// "
                                    f"for {host!r}")
        return Target(url, scheme, host, port, _plain(ipaddress.ip_address(
            addresses[0].split("%")[0])).compressed)


def download(url: str, policy: EgressPolicy, sink: BinaryIO, *, max_bytes: int,
             expected_sha256: str | None = None, timeout: float = 30.0,
             max_redirects: int = MAX_REDIRECTS) -> tuple[str, int]:
    """Stream ``url`` into ``sink``; returns (sha256 hex, size).

    Every hop (redirects included) is checked by ``policy`` before anything is sent to it. The
    transfer stops as soon as more than ``max_bytes`` arrived (a ``Content-Length`` over the cap
    stops it before the body). With ``expected_sha256`` a mismatch raises ``DownloadError``.
    """
    current = url
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        for _hop in range(max_redirects + 1):
            target = policy.check(current)
            try:
                response = client.send(target.request(client, "GET"), stream=True)
            except httpx.HTTPError as err:
                raise DownloadError(f"cannot download {current!r}: {err}") from None
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    current = urljoin(current, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise DownloadError(f"GET {current!r} answered HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise DownloadError(f"{current!r} is {int(declared)} bytes, more than the "
                                        f"{max_bytes} allowed")
                digest, size = hashlib.sha256(), 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise DownloadError(f"{current!r} is more than the {max_bytes} bytes "
                                            "allowed; download stopped")
                    digest.update(chunk)
                    sink.write(chunk)
            except httpx.HTTPError as err:
                raise DownloadError(f"cannot download {current!r}: {err}") from None
            finally:
                response.close()
            hexdigest = digest.hexdigest()
            if expected_sha256 is not None and hexdigest != expected_sha256:
                raise DownloadError(f"sha256 of the bytes at {url!r} is {hexdigest}, not "
                                    f"{expected_sha256}: the file changed or the hash is wrong")
            return hexdigest, size
    raise DownloadError(f"{url!r} redirected more than {max_redirects} times")


__all__ = [
    "ALLOWED_HOSTS_ENV",
    "DEFAULT_MAX_DOWNLOAD_BYTES",
    "MAX_REDIRECTS",
    "METADATA_ADDRESSES",
    "PUBLIC_ENV",
    "AllowEntry",
    "DownloadError",
    "EgressPolicy",
    "EgressRefused",
    "Target",
    "download",
]
