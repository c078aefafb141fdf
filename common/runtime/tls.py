"""TLS on the public port and mutual TLS on the internal plane, from PEM files.

Two planes (router/server.py): the router's public port (Generation, health,
reflection) takes TLS from `--ssl-certfile/--ssl-keyfile`, clients check it against
`--ssl-ca-certs`; every internal connection (router <-> workers, worker <-> worker KV
pulls, worker -> router registry and prefix index) takes mutual TLS from
`--internal-ssl-certfile/--internal-ssl-keyfile/--internal-ssl-ca-certs`: each side
shows a certificate signed by the internal CA and checks the other's against it, so
a process without such a certificate can neither serve as a worker (its heartbeats
are refused) nor call one.

Names. gRPC checks the server certificate's subjectAltName against the host it
dials: workers are dialled at their advertised host (WorkerConfig.advertise_host, else
their listen host) and the router's internal listener at the address the workers are
given, so each certificate must carry those names (a DNS name or an IP address SAN;
e.g. "127.0.0.1" and "localhost" on one machine, the pod IP or Service name on
Kubernetes). There is deliberately no target-name override: a certificate that does
not name its host is a configuration error, refused by the handshake (UNAVAILABLE).
One certificate with every name may serve the router and all workers, since the
internal CA is the trust boundary: every holder of a certificate it signed is trusted
as a peer.

The files are read when a server or channel is built: a rotated certificate takes
effect at the process's next start.

An edge module (gRPC): the engine core never imports it; the router and the client
do (no torch here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from pagedserve.common.api.limits import ConfigError


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: this end's certificate chain and private key, and the CA it trusts.

    Public plane (RouterConfig.public_tls): certfile and keyfile; the server ignores
    ca_certs (clients are not asked for certificates; `pagedserve up --demo` trusts it).
    Internal plane (`internal_tls` of
    RouterConfig, WorkerConfig, ClusterSpec): all three, mutual TLS.
    """

    # Optional in the signature only so that the flags (--ssl-*, --internal-ssl-*:
    # common/api/settings.py builds this from whichever were given) get the message
    # below, not a TypeError; both are required.
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    def __post_init__(self) -> None:
        if self.certfile is None or self.keyfile is None:
            raise ConfigError(
                "TLS needs a certificate and its key: certfile and keyfile "
                "(--ssl-certfile and --ssl-keyfile, or --internal-ssl-certfile and "
                "--internal-ssl-keyfile)"
            )
        for name in ("certfile", "keyfile", "ca_certs"):
            path = getattr(self, name)
            if path is None:
                continue
            if not Path(path).is_file():
                raise ConfigError(f"TLS {name} {str(path)!r} does not exist or is not a file")

    def require_ca(self, what: str) -> str:
        """ca_certs, or a ConfigError naming `what` needs it (mutual TLS does)."""
        if self.ca_certs is None:
            raise ConfigError(
                f"{what} needs a CA file (ca_certs, --internal-ssl-ca-certs) to check its peers"
            )
        return self.ca_certs


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _key_pair(tls: TLSFiles) -> tuple[bytes, bytes]:
    assert tls.certfile is not None and tls.keyfile is not None  # __post_init__ checked
    return _read(tls.keyfile), _read(tls.certfile)


def public_server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server TLS without client certificates (the public port: clients use API keys)."""
    return grpc.ssl_server_credentials([_key_pair(tls)], require_client_auth=False)


def internal_server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server mutual TLS: a client must show a certificate signed by the internal CA."""
    ca = _read(tls.require_ca("an internal (mutual TLS) server"))
    return grpc.ssl_server_credentials(
        [_key_pair(tls)], root_certificates=ca, require_client_auth=True
    )


def internal_channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    """Client mutual TLS: checks the server against the internal CA, shows our cert."""
    key, chain = _key_pair(tls)
    ca = _read(tls.require_ca("an internal (mutual TLS) channel"))
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=chain
    )


def client_channel_credentials(ca_certs: str | None = None) -> grpc.ChannelCredentials:
    """A public client's TLS: the server is checked against `ca_certs` (None = the
    system's roots, for a certificate from a public CA)."""
    if ca_certs is not None and not Path(ca_certs).is_file():
        raise ConfigError(f"TLS ca_certs {ca_certs!r} does not exist or is not a file")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_certs) if ca_certs else None)


def add_port(server: grpc.Server | grpc.aio.Server, address: str, creds) -> int:
    """Binds `address` with TLS when `creds` (grpc.ServerCredentials) is given, else
    plaintext; returns the port (0 when binding failed, as gRPC does)."""
    if creds is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, creds)


def channel(
    address: str, creds: grpc.ChannelCredentials | None, options: list | None = None
) -> grpc.Channel:
    """A sync channel to `address`: TLS when `creds` is given, else plaintext."""
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def aio_channel(
    address: str, creds: grpc.ChannelCredentials | None, options: list | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS when `creds` is given, else plaintext."""
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)
