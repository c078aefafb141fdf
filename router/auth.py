"""API keys and tenants on the public API: who is calling, whose cache, how many at once.

A caller presents `authorization: Bearer <key>` (gRPC metadata; the HTTP gateway passes
its `Authorization` header through as the same metadata). `Authenticator.authenticate`
maps the key to a `Tenant` or raises `AuthError` (the Generation servicer answers
UNAUTHENTICATED before it looks at the request: no tokenizing, no admission, no model
work). Keys come from `RouterConfig.api_key` (one key, tenant "default", as `vllm serve
--api-key`) and/or `RouterConfig.api_keys_file` (several keys, each with a tenant and
an optional concurrency limit). With neither the API is open, as before: every caller
is `OPEN_TENANT`, so `pagedserve up` on loopback works unconfigured.

Comparison: every presented key is checked against *every* configured key with
`hmac.compare_digest` over SHA-256 digests (equal lengths, so a key's length does not
leak either), without stopping at the first match, so timing reveals neither whether
nor which key matched early.

The tenant decides the cache salt (`Tenant.cache_salt`, the one place the effective
salt is computed): a keyed tenant's requests hash their blocks under
SHA-256(tenant name, client salt), length-prefixed, so a client's `cache_salt` only
splits its own tenant's cache further and can never select another tenant's blocks;
`cached_tokens` in the usage then only counts the caller's own tenant's hits. The
tenant part is the tenant's *name*, not a server secret: isolation comes from the
router choosing it after authentication (a client never sees block hashes or the salt),
and a name is the same on every router replica and across restarts, which the shared
Redis index and the workers' caches need; a secret would add nothing against clients
but would have to be distributed to every replica and kept forever. (It would only
matter if an *open* router, whose clients choose raw salts, shared workers with a keyed
one: do not mix them.) The open tenant keeps the client's salt as it is (today's
hashes).

Limits: a tenant with `max_inflight` has at most that many requests running or queued
on this router (`TenantLimits`); one more is RESOURCE_EXHAUSTED. The limit is the
tenant's, not a key's: several keys of one tenant (key rotation) share it.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedserve.common.api.limits import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the tenant of `--api-key` and of the open API
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
MISSING_KEY = f"missing API key: send '{METADATA_KEY}: Bearer <key>'"
INVALID_KEY = "invalid API key"
MALFORMED = f"invalid API key: the {METADATA_KEY} metadata must be 'Bearer <key>'"

# Tenant names appear in messages and could become metric labels: keep them plain.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A key travels as an ASCII metadata value after "Bearer ": printable, no whitespace.
_KEY = re.compile(r"[\x21-\x7e]+")
_SALT_DOMAIN = b"pagedserve tenant cache salt v1\x00"


class AuthError(Exception):
    """No key, or not a configured one; the message is what the caller is told."""


class TenantLimitExceeded(Exception):
    """The tenant already has `max_inflight` requests; the message says so."""


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to: its name, its cache salt, its concurrency limit."""

    name: str
    # The tenant's part of every cache salt: its name for a keyed tenant; None for the
    # open API (no keys configured), whose requests keep the client's salt as it is.
    salt: str | None
    max_inflight: int | None = None  # requests running or queued at once; None = no limit

    def request_id(self, client_rid: str) -> str:
        """The id the router and the workers know a request by: unique per tenant, so
        one tenant's ids never clash with (or reveal) another's in-flight ids. The open
        tenant's ids are the client's own; a keyed tenant's are prefixed with its name
        (names are [A-Za-z0-9._-], so ':' cannot be forged into another tenant's).
        Responses carry the client's id back (router/dispatch.py)."""
        return client_rid if self.salt is None else f"{self.name}:{client_rid}"

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The salt a request's blocks are hashed under: the tenant's combined with the
        client's (`client_salt`, "" or None = none), never the client's alone.

        SHA-256 over length-prefixed fields (with a presence byte for the client salt),
        so no (tenant, client salt) pair collides with another by concatenation, and
        "" and no salt stay one and the same (the proto cannot tell them apart).
        """
        if self.salt is None:
            return client_salt or None
        h = hashlib.sha256(_SALT_DOMAIN)
        for part in (self.salt, client_salt or None):
            if part is None:
                h.update(b"\x00")
            else:
                data = part.encode()
                h.update(b"\x01" + struct.pack("<Q", len(data)) + data)
        return h.hexdigest()


OPEN_TENANT = Tenant(DEFAULT_TENANT, salt=None)


def keyed_tenant(name: str, max_inflight: int | None = None) -> Tenant:
    """A tenant of a configured key: its salt is its name (see the module docstring)."""
    return Tenant(name, salt=name, max_inflight=max_inflight)


class Authenticator:
    """Maps `authorization: Bearer <key>` to a Tenant; open when no key is configured."""

    def __init__(self, keys: Mapping[str, Tenant]) -> None:
        # Digests, not keys: compared at equal length, and no key lingers in plain text.
        self._keys = [(_digest(k), t) for k, t in keys.items()]
        self.tenants: dict[str, Tenant] = {t.name: t for t in keys.values()}

    @classmethod
    def from_config(cls, api_key: str | None, api_keys_file: str | None) -> Authenticator:
        """From RouterConfig.api_key / api_keys_file; raises ConfigError naming the
        problem (and the file's line) so that a bad configuration stops the start."""
        keys: dict[str, Tenant] = {}
        if api_keys_file is not None:
            keys.update(load_keys_file(api_keys_file))
        if api_key is not None:
            _check_key(api_key, "api_key")
            if api_key in keys:
                raise ConfigError(f"api_key is also a key in {api_keys_file}: give it once")
            keys[api_key] = _tenant_named(keys, DEFAULT_TENANT)
        return cls(keys)

    @property
    def open(self) -> bool:
        """No key configured: every caller is OPEN_TENANT."""
        return not self._keys

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The caller's tenant, from its invocation metadata; raises AuthError."""
        if self.open:
            return OPEN_TENANT
        values = [v for k, v in metadata or () if k.lower() == METADATA_KEY]
        if not values:
            raise AuthError(MISSING_KEY)
        if len(values) > 1:
            raise AuthError(f"invalid API key: send one '{METADATA_KEY}' metadata entry")
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("ascii", errors="replace")
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError(MALFORMED)
        presented = _digest(key.strip())
        found: Tenant | None = None
        for digest, tenant in self._keys:  # all of them, every time: no early exit
            if hmac.compare_digest(digest, presented):
                found = tenant
        if found is None:
            raise AuthError(INVALID_KEY)
        return found


class TenantLimits:
    """Requests running or queued per tenant, against each tenant's `max_inflight`.

    Runs on the router's event loop (no locks); every `acquire` that returned is
    matched by one `release` when the request ends, however it ends.
    """

    def __init__(self) -> None:
        self.inflight: collections.Counter[str] = collections.Counter()

    def acquire(self, tenant: Tenant) -> None:
        """Counts a request of `tenant`; raises TenantLimitExceeded at its limit."""
        limit = tenant.max_inflight
        if limit is not None and self.inflight[tenant.name] >= limit:
            raise TenantLimitExceeded(
                f"tenant {tenant.name!r} has {self.inflight[tenant.name]} requests running "
                f"or queued, its limit (max_inflight {limit}): retry when one has ended"
            )
        self.inflight[tenant.name] += 1

    def release(self, tenant: Tenant) -> None:
        self.inflight[tenant.name] -= 1
        assert self.inflight[tenant.name] >= 0, "release() without acquire()"
        if not self.inflight[tenant.name]:
            del self.inflight[tenant.name]


def load_keys_file(path: str | os.PathLike[str]) -> dict[str, Tenant]:
    """Reads an API keys file: one `KEY TENANT [MAX_INFLIGHT]` per line.

    Blank lines and lines starting with `#` are skipped; fields are separated by
    whitespace. KEY is printable ASCII without spaces (it travels as gRPC metadata);
    TENANT is 1-64 of letters, digits, `.`, `_`, `-`; MAX_INFLIGHT a positive integer.
    Several keys may name one tenant (rotation): the limit is the tenant's, so the
    lines that give one must agree, and a line without one takes its tenant's.

    A plain line format, not YAML or JSON: no parser dependency, one line per key is
    what `echo KEY tenant >> keys` and a Kubernetes Secret's file hold, and a line
    number points at every mistake. A bad line or a duplicate key raises ConfigError
    naming the file and the line (never the key).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"api_keys_file {str(p)!r} cannot be read: {e.strerror}") from None
    _warn_if_readable_by_others(p)
    tenant_of: dict[str, str] = {}  # key -> tenant name
    first_line: dict[str, int] = {}  # key -> line
    limits: dict[str, tuple[int | None, int]] = {}  # tenant -> (limit, line that gave it)
    for n, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{p}:{n}"
        if len(fields) not in (2, 3):
            raise ConfigError(
                f"{where}: expected 'KEY TENANT [MAX_INFLIGHT]', got {len(fields)} fields"
            )
        key, name = fields[0], fields[1]
        _check_key(key, where)
        _check_tenant_name(name, where)
        if key in first_line:
            raise ConfigError(f"{where}: duplicate key (first on line {first_line[key]})")
        limit = _max_inflight(fields[2], where) if len(fields) == 3 else None
        given, given_on = limits.get(name, (None, n))
        if limit is not None and given is not None and limit != given:
            raise ConfigError(
                f"{where}: tenant {name!r} has max_inflight {given} (line {given_on}); "
                "the limit is the tenant's: give the same one on each of its keys"
            )
        if limit is not None and given is None:
            limits[name] = (limit, n)
        tenant_of[key], first_line[key] = name, n
    if not tenant_of:
        raise ConfigError(f"api_keys_file {str(p)!r} holds no key: the API would be open")
    tenants = {
        name: keyed_tenant(name, limits.get(name, (None, 0))[0]) for name in tenant_of.values()
    }
    return {key: tenants[name] for key, name in tenant_of.items()}


def _tenant_named(keys: Mapping[str, Tenant], name: str) -> Tenant:
    """The tenant `name` among `keys`' tenants, or a new one without a limit."""
    return next((t for t in keys.values() if t.name == name), None) or keyed_tenant(name)


def _check_tenant_name(name: str, where: str) -> None:
    if not _TENANT_NAME.fullmatch(name):
        raise ConfigError(f"{where}: tenant {name!r} must be 1-64 letters, digits, '.', '_' or '-'")


def _check_key(key: str, where: str) -> None:
    if not _KEY.fullmatch(key):
        raise ConfigError(f"{where}: a key must be printable ASCII without spaces")


def _max_inflight(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{where}: MAX_INFLIGHT must be a positive integer, got {text!r}")
    return value


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()


def _warn_if_readable_by_others(p: Path) -> None:
    try:
        mode = p.stat().st_mode
    except OSError:
        return
    if mode & 0o004:
        logger.warning("api_keys_file %s is readable by every user: chmod o-r it", p)
