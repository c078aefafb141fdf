"""Redis with a password: the index and the registry work through a URL that carries
it, a wrong or missing one is a clear error, and no message shows the password.

Real redis-server (tests/fixtures_redis.py, ``--requirepass``); the Kubernetes ACL
user of deploy/k8s/components/redis is exercised in tests/test_deploy.py.
"""

from __future__ import annotations

import pytest

from pagedserve.common.runtime.prefix_index.base import (
    ApplyResult,
    EventBatch,
    EventKind,
    IndexEvent,
    IndexUnavailableError,
)
from pagedserve.common.runtime.prefix_index.connection import check_url, redact_url
from pagedserve.common.runtime.prefix_index.redis import RedisPrefixIndex
from pagedserve.common.runtime.prefix_index.worker_registry import RedisWorkerRegistry

pytest_plugins = ["fixtures_redis"]

PASSWORD = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
WRONG = "ffffeeeeddddccccbbbbaaaa99998888"
HASHES = [bytes([i]) * 16 for i in range(1, 4)]


def stored(worker: str, seq: int, hashes: list[bytes]) -> EventBatch:
    return EventBatch(worker, seq, tuple(IndexEvent(EventKind.STORED, h) for h in hashes))


def test_index_and_registry_work_with_the_password_in_the_url(redis_server_factory):
    server = redis_server_factory.start(password=PASSWORD)
    assert server.url == f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    index = RedisPrefixIndex(server.url, "auth")
    registry = RedisWorkerRegistry(server.url)
    try:
        index.heartbeat("w0", ttl_s=30.0)  # a worker's hello: heartbeat, then its list
        index.resync("w0", HASHES[:2], next_seq=0)
        assert index.apply(stored("w0", 0, HASHES[2:])) is ApplyResult.APPLIED
        assert index.match(HASHES) == {"w0": 3}
        registry.publish("w0", b"stats", ttl_s=30.0)
        assert registry.read() == {"w0": b"stats"}
        assert PASSWORD not in index.url and PASSWORD not in registry.url
    finally:
        index.close()
        registry.close()


@pytest.mark.parametrize(
    ("auth", "server_says"),
    [(f":{WRONG}@", "invalid username-password pair"), ("", "AuthenticationError")],
    ids=["wrong-password", "no-password"],
)
def test_a_wrong_or_missing_password_is_a_clear_error_that_hides_it(
    redis_server_factory, auth, server_says
):
    server = redis_server_factory.start(password=PASSWORD)
    url = f"redis://{auth}127.0.0.1:{server.port}/0"
    index = RedisPrefixIndex(url, "auth")
    registry = RedisWorkerRegistry(url)
    try:
        with pytest.raises(IndexUnavailableError) as index_error:
            index.match(HASHES)
        with pytest.raises(IndexUnavailableError) as registry_error:
            registry.publish("w0", b"stats", ttl_s=30.0)
    finally:
        index.close()
        registry.close()
    for error in (index_error, registry_error):
        message = str(error.value)
        assert "AuthenticationError" in message and server_says in message, message
        assert "Redis refused the credentials" in message
        assert f"127.0.0.1:{server.port}" in message
        assert WRONG not in message and PASSWORD not in message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://pagedserve:s3cret@redis:6379/0", "redis://pagedserve:***@redis:6379/0"),
        ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
        ("rediss://u:p@ss:word@h/0", "rediss://u:***@h/0"),  # an unencoded '@'
        ("redis://u:s3cret@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
        ("redis://h/0?password=s3cret&db=1", "redis://h/0?password=***&db=1"),
        ("unix:///run/r.sock?password=s3cret", "unix:///run/r.sock?password=***"),
        (
            "rediss://u:s3cret@h/0?ssl_ca_certs=/etc/ca.crt",
            "rediss://u:***@h/0?ssl_ca_certs=/etc/ca.crt",
        ),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
        ("unix:///run/r.sock", "unix:///run/r.sock"),
    ],
)
def test_redact_url_masks_every_password_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown


def test_a_bad_url_scheme_error_hides_the_password():
    with pytest.raises(ValueError, match=r"http://pagedserve:\*\*\*@redis") as error:
        check_url("http://pagedserve:s3cret@redis:6379/0")
    assert "s3cret" not in str(error.value)


def test_configs_never_show_a_redis_password():
    """The configs' reprs (logged, printed in errors) leave the URL out altogether."""
    from pagedserve.common.runtime.worker import WorkerConfig
    from pagedserve.launch import ClusterSpec
    from pagedserve.router.config import RouterConfig

    url = "redis://pagedserve:s3cret-pw@redis:6379/0"
    for config in (
        RouterConfig(redis_url=url),
        WorkerConfig(worker_id="w", pool="decode", redis_url=url),
        ClusterSpec(redis_url=url),
    ):
        assert config.redis_url == url
        assert "s3cret-pw" not in repr(config)
