"""A standalone router: `python -m pagedserve.router --model DIR --port 50051`.

Two listeners (router/server.py): the public `--port` serves only Generation, health and
reflection; workers join by heartbeat on the internal listener (`--internal-host`,
`--internal-port`: WorkerConfig.registry_address and index_address name it). Its port
defaults to 0 (any free one, logged at start): give workers started on their own a
fixed `--internal-port` (`pagedserve up` uses 50052). TLS: `--ssl-certfile/--ssl-keyfile`
on the public port, `--internal-ssl-certfile/-keyfile/-ca-certs` (mutual TLS) inside.
The launcher (`pagedserve up`) runs the same router in its own process instead.

SIGTERM or Ctrl-C drains (router/server.py `Router.drain`): new requests get
UNAVAILABLE, health reports NOT_SERVING, the streams in flight get
`--shutdown-grace-s` to finish (a second signal ends the grace at once); then the
process exits 0. Workers outlive it and register again with whichever router next
serves at the address they dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass

from jsonargparse import ArgumentParser

from pagedserve import __version__
from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.settings import Root, Schema
from pagedserve.router.auth import Authenticator
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import serve


@dataclass(frozen=True)
class ServeOptions:
    """The router process's own settings (the same flags as `pagedserve up`'s)."""

    # on SIGTERM/Ctrl-C: seconds the streams in flight get to finish (under Kubernetes'
    # default 30 s termination grace)
    shutdown_grace_s: float = 25.0
    # A standalone router's logs are its only output (`pagedserve up` defaults to
    # WARNING: it prints its own progress, and Ray streams the workers' logs to it).
    log_level: str = "INFO"


def settings_schema() -> Schema:
    """Every RouterConfig field is a flag (common/api/settings.py)."""
    return Schema(
        prog="python -m pagedserve.router",
        description=__doc__,
        roots=[Root("router", RouterConfig), Root("serve", ServeOptions)],
        version=__version__,
    )


def build_parser() -> ArgumentParser:
    return settings_schema().parser()


def parse_config(argv: list[str] | None = None) -> tuple[RouterConfig, ServeOptions]:
    schema = settings_schema()
    parser = schema.parser()
    built = schema.build(parser.parse_args(argv), parser)
    config = built["router"]
    try:  # a bad keys file is a usage error naming its line, before anything starts
        Authenticator.from_config(config.api_key, config.api_keys_file)
    except ConfigError as e:
        parser.error(str(e))
    return config, built["serve"]


def main(argv: list[str] | None = None) -> int:
    config, options = parse_config(argv)
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(name)s: %(message)s")
    # serve() handles SIGTERM and SIGINT itself (drain, then return).
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(serve(config, shutdown_grace_s=options.shutdown_grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
