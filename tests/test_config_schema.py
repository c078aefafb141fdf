"""One config schema for every entry point (common/api/settings.py).

Walks every field of every config dataclass and checks that each is reachable from the
entry points that take it — `pagedserve up` (into ClusterSpec, the RouterConfig the
launcher builds and the WorkerConfig every Ray actor receives), `python -m
pagedserve.router`, and a YAML `--config` file — with one and the same default. No Ray,
no model: the launcher's config builders (Cluster.router_config / worker_config) are
pure.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

import pagedserve
from benchmarks import engine_throughput, prefix_routing
from pagedserve import admin_cli, cli, launch
from pagedserve.common.api import settings
from pagedserve.common.api.settings import (
    CLI_DEFAULTS,
    NOT_FLAGS,
    Root,
    Schema,
    SchemaError,
    Setting,
)
from pagedserve.common.core.config import EngineConfig, GiB
from pagedserve.common.runtime.worker import WorkerConfig
from pagedserve.router import __main__ as router_main
from pagedserve.router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[1]
ADDRESS = "10.0.0.9:50051"  # the router as workers dial it (never dialled here)

# Dests both entry points take whose defaults differ on purpose (the reason is at the
# field: ServeOptions.log_level).
DIFFERENT_DEFAULTS = {"log_level"}
HTTP_PORT = CLI_DEFAULTS["RouterConfig.http_port"]  # the OpenAI API: on from a command line
# The internal port: a fixed 50052 from both command lines (workers and `pagedserve
# status` dial it), RouterConfig's 0 for routers built in code (tests stay apart).
INTERNAL_PORT = CLI_DEFAULTS["RouterConfig.internal_port"]


# Values a field's own check needs (the generic "default + something" would fail it).
def _keys_file() -> str:
    """A readable API-keys file: the entry points check the file when they parse."""
    path = Path(tempfile.mkdtemp(prefix="pagedserve-schema-")) / "keys"
    path.write_text("k-schema-test tenant-a\n")
    path.chmod(0o600)
    return str(path)


def _pem_file(name: str) -> str:
    """An existing file: TLSFiles checks its paths when built (read only at start)."""
    path = Path(tempfile.mkdtemp(prefix="pagedserve-schema-")) / name
    path.write_text("not read at parse time\n")
    return str(path)


SPECIAL_VALUES: dict[str, Any] = {
    "api_keys_file": _keys_file(),
    **{
        f"{plane}ssl_{part}": _pem_file(f"{plane}{part}")
        for plane in ("", "internal_")
        for part in ("certfile", "keyfile", "ca_certs")
    },
    "redis_url": "redis://127.0.0.1:6399/0",
    "log_level": "DEBUG",
    "model": "/models/x",
    "ray_address": "auto",  # with --detach-workers, which needs it
}


def other_value(s: Setting) -> Any:
    """A valid value for `s` unlike its default."""
    if s.dest in SPECIAL_VALUES:
        return SPECIAL_VALUES[s.dest]
    tp, default = s.type, s.default
    if typing.get_origin(tp) in (typing.Union, type(int | None)):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    if tp is bool:
        return not default
    if tp is int:
        return (default or 0) + 3
    if tp is float:
        return (default or 0.0) + 0.5
    if tp is str:
        return f"{default or ''}x"
    raise AssertionError(f"no test value for {s.key}: {tp}")


def as_argv(values: dict[str, Any], schema: Schema) -> list[str]:
    argv: list[str] = []
    for dest, v in values.items():
        flag = schema.setting(dest).flags[0]
        if isinstance(v, bool):
            argv.append(flag if v else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(v)]
    return argv


def get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
    return obj


def up_views(argv: list[str]) -> dict[str, Any]:
    """What `pagedserve up argv` configures: root name -> the object that root lands in."""
    spec, options = launch.parse_spec(argv)
    cluster = launch.Cluster(spec)
    return {
        "spec": spec,
        "router": cluster.router_config(),
        "worker": cluster.worker_config("decode", 1, ADDRESS),
        "launch": options,
    }


def leaf_links(
    schema: Schema, first_root: bool = False
) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(root, field path, source path in the first root) of every linked leaf field.

    Links inside the first root (ClusterSpec.engine.model) only with `first_root`: the
    launcher applies them to the workers' copy (checked there), not to the spec."""
    out = []
    # Parsed once: a parse builds the whole schema (~0.5 s), and one per link made this
    # ~40 parses, the bulk of this file's time.
    defaults = default_views()
    for link in schema.linked:
        if link.root == schema.roots[0].name and not first_root:
            continue
        cls = type(get_path(defaults[link.root], link.path))
        if cls is type(None):  # an `X | None` dataclass (TLSFiles): None by default
            parent = get_path(defaults[link.root], link.path[:-1])
            hint = typing.get_type_hints(type(parent))[link.path[-1]]
            cls = settings._nested_dataclass(hint)[0] or cls
        if not dataclasses.is_dataclass(cls):
            out.append((link.root, link.path, link.source))
            continue
        for sub, key in settings.leaf_fields(cls):
            source = schema.links.get(key)
            src = tuple(source.split(".")) if source else (*link.source, *sub)
            out.append((link.root, (*link.path, *sub), src))
    return out


def default_views() -> dict[str, Any]:
    return up_views([])


# -- every field, every entry point ------------------------------------------------------


def test_every_config_field_is_a_flag_a_link_or_named_as_internal():
    schema = launch.settings_schema()
    covered = {(s.root, s.path) for s in schema.settings}
    covered |= {(root, path) for root, path, _ in leaf_links(schema, first_root=True)}
    for root in schema.roots:
        for path, key in settings.leaf_fields(root.cls):
            if key in NOT_FLAGS:
                continue
            assert (root.name, path) in covered, f"{key} is not reachable from pagedserve up"
    router = router_main.settings_schema()
    for path, key in settings.leaf_fields(RouterConfig):
        assert router.setting_at("router", path) is not None, key
    # The internals are named, each with its reason, and are no flag.
    assert all(NOT_FLAGS.values())
    assert not [s.key for s in schema.settings if s.key in NOT_FLAGS]
    assert set(schema.skipped) == {k for k in NOT_FLAGS if not k.startswith("Cluster")} | {
        "ClusterSpec.router_options",
        "ClusterSpec.worker_options",
    }


def test_up_reaches_every_field_with_one_value_flags_and_yaml(tmp_path):
    """One non-default value per setting, as flags and as a YAML file: each lands in
    its field of the spec, the router's config or every worker's config; each link
    carries its source's value."""
    schema = launch.settings_schema()
    values = {s.dest: other_value(s) for s in schema.settings}
    values["port"] = 50099  # --detach-workers needs a fixed port
    demo = values.pop("demo")  # --demo turns the HTTP API off: checked on its own below
    from_flags = up_views(as_argv(values, schema))
    config = tmp_path / "up.yaml"
    config.write_text(yaml.safe_dump(values))
    from_yaml = up_views(["--config", str(config)])
    links = leaf_links(schema)
    for views in (from_flags, from_yaml):
        for s in schema.settings:
            if s.dest == "demo":
                continue
            got = get_path(views[s.root], s.path)
            assert got == values[s.dest], f"{s.flags[0]} -> {s.key}: {got!r}"
        for root, path, source in links:
            want = get_path(views["spec"], source)
            assert get_path(views[root], path) == want, f"{root}.{'.'.join(path)}"
    assert from_flags == from_yaml
    spec, options = launch.parse_spec(["--demo", demo, "--http-port", "8001"])
    assert options.demo == demo and spec.router_http_port is None  # one request, no HTTP


def test_up_defaults_are_the_dataclasses_defaults():
    views = default_views()
    spec = views["spec"]
    # The dataclasses' defaults, but for the command lines' own (settings.CLI_DEFAULTS).
    cli_spec = dataclasses.replace(launch.ClusterSpec(), router_http_port=HTTP_PORT)
    assert dataclasses.replace(spec, router_options={}, worker_options={}) == cli_spec
    # The router the launcher starts, and every worker, get the classes' own defaults.
    assert views["router"] == RouterConfig(http_port=HTTP_PORT, internal_port=INTERNAL_PORT)
    worker = views["worker"]
    derived = {k.split(".")[1] for k in NOT_FLAGS if k.startswith("WorkerConfig.")}
    plain = WorkerConfig(worker_id="decode-1", pool="decode")
    for f in dataclasses.fields(WorkerConfig):
        if f.name not in derived:
            assert getattr(worker, f.name) == getattr(plain, f.name), f.name
    assert views["launch"].max_tokens == cli.DEFAULT_MAX_TOKENS


def test_router_reaches_every_field_with_the_same_defaults(tmp_path):
    schema = router_main.settings_schema()
    assert router_main.parse_config([]) == (
        RouterConfig(http_port=HTTP_PORT, internal_port=INTERNAL_PORT),
        router_main.ServeOptions(),
    )
    values = {s.dest: other_value(s) for s in schema.settings}
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(values))
    for argv in (as_argv(values, schema), ["--config", str(config)]):
        router, serve = router_main.parse_config(argv)
        views = {"router": router, "serve": serve}
        for s in schema.settings:
            assert get_path(views[s.root], s.path) == values[s.dest], s.flags[0]


def test_entry_points_agree_on_flags_and_defaults():
    """A flag both commands take means one field with one default."""
    up = {s.dest: s for s in launch.settings_schema().settings}
    router = {s.dest: s for s in router_main.settings_schema().settings}
    shared = up.keys() & router.keys()
    assert {"max_model_len", "redis_url", "port", "host", "metrics_port"} <= shared
    for dest in shared - DIFFERENT_DEFAULTS:
        assert up[dest].default == router[dest].default, dest
        assert up[dest].flags == router[dest].flags, dest


def test_vllm_flag_names_and_old_spellings():
    spec, _ = launch.parse_spec(
        ["--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
        + ["--block-size", "32", "--no-enable-prefix-caching", "--dtype", "float32"]
        + ["--kv-cache-memory-bytes", "12345", "--no-prefix-routing"]
    )
    e = spec.engine
    assert (e.scheduler.max_model_len, e.scheduler.max_num_seqs) == (4096, 8)
    assert (e.scheduler.max_num_batched_tokens, e.cache.block_size) == (512, 32)
    assert not e.cache.enable_prefix_caching and e.dtype == "float32"
    assert e.cache.kv_cache_bytes == 12345
    router = launch.Cluster(spec).router_config()
    assert router.max_model_len == 4096 and not router.prefix.enabled
    # The GiB form wins over the bytes form.
    spec, _ = launch.parse_spec(["--kv-cache-gib", "0.5", "--kv-cache-memory-bytes", "7"])
    assert spec.engine.cache.kv_cache_bytes == GiB // 2
    # Router-only flags work on `up` too, and its workers' own settings.
    spec, _ = launch.parse_spec(["--worker-timeout-s", "9", "--disagg-min-prompt-tokens", "0"])
    assert (spec.worker_timeout_s, spec.disagg_min_prompt_tokens) == (9.0, 0)
    spec, _ = launch.parse_spec(["--kv-pull-timeout-s", "7", "--max-inflight", "5"])
    assert launch.Cluster(spec).worker_config("prefill", 0, ADDRESS).kv_pull_timeout_s == 7.0
    assert launch.Cluster(spec).router_config().max_inflight == 5


def test_readme_flags_parse():
    """Every server flag the README mentions is `pagedserve up`'s, and its commands parse."""
    readme = (ROOT / "README.md").read_text()
    up = {f for s in launch.settings_schema().settings for f in s.flags}
    up |= {"--kv-cache-gib", "--demo", "--max-tokens", "--config", "--version", "--no-http"}
    up |= {f"--no-{f[2:]}" for f in up}
    client = {o for a in cli.build_parser()._actions for o in a.option_strings}
    for sub in ("generate", "chat"):
        client |= _subparser_flags(sub)
    for sub in ("status", "scale"):
        client |= {o for a in admin_cli.build_parser(sub)._actions for o in a.option_strings}
    # ray start --head; benchmarks' flags (those of the two whose flags the README's
    # benchmark table names come from their own parsers)
    other = {"--head", "--json", "--profile", "--api", "--vllm-python"}
    for parser in (engine_throughput._parser(), prefix_routing.build_parser()):
        other |= {o for a in parser._actions for o in a.option_strings}
    # `vllm bench serve` against the HTTP API (vLLM's own flags)
    other |= {"--backend", "--base-url", "--endpoint", "--tokenizer", "--dataset-name"}
    other |= {"--num-prompts"}
    mentioned = set(re.findall(r"--[a-z][a-z0-9-]+", readme))
    assert mentioned - up - client - other == set()
    for command in _commands(readme, "pagedserve up"):
        launch.parse_spec(command)
    for command in _commands(readme, "python -m pagedserve.router"):
        router_main.parse_config(command)


def _subparser_flags(name: str) -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd").choices[name]
    return {o for a in sub._actions for o in a.option_strings}


def _commands(text: str, prefix: str) -> list[list[str]]:
    """The arguments of each `prefix ...` in the README (continuations joined, optional
    [...] parts taken, placeholders filled)."""
    text = text.replace("\\\n", " ")
    out = []
    for m in re.finditer(re.escape(prefix) + r"((?:\s+--?[a-z][^`\n#]*)?)", text):
        args = m.group(1).replace("[", " ").replace("]", " ")
        args = args.replace("redis://...", "redis://127.0.0.1:6379/0")
        args = args.replace("--redis-url ...", "--redis-url redis://127.0.0.1:6379/0")
        tokens = [t for t in shlex.split(args) if t != "..."]
        tokens = ["50052" if t in ("P", "Q") else t for t in tokens]
        out.append(tokens)
    assert out, prefix
    return out


def test_help_shows_defaults(capsys):
    for parser in (launch.build_parser(), router_main.build_parser()):
        assert "default: 50051" in _help_of(parser, capsys, "--port")
        assert "default: null" in _help_of(parser, capsys, "--max-model-len")
        assert "default: 32" in _help_of(parser, capsys, "--disagg-min-prompt-tokens")
        assert "YAML" in _help_of(parser, capsys, "--config")
    assert "default: 1024" in _help_of(launch.build_parser(), capsys, "--max-num-waiting-seqs")


def _help_of(parser, capsys, flag: str) -> str:
    """`flag`'s entry in --help, on one line."""
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    start = text.index(f"\n  {flag} ")
    end = text.find("\n  -", start + 3)
    return " ".join(text[start : end if end > 0 else None].split())


def test_version_prints_the_package_version(capsys):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert pagedserve.__version__ == version
    for parse in (launch.parse_spec, router_main.parse_config, cli.main):
        with pytest.raises(SystemExit) as e:
            parse(["--version"])
        assert e.value.code == 0
        assert capsys.readouterr().out.strip().endswith(f" {version}")


def test_yaml_sets_nested_fields_and_flags_override_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "max_num_seqs: 8\nblock_size: 32\nprefix_routing: false\nprefix_weight: 2.5\n"
        "kv_pull_timeout_s: 11\nmax_inflight: 7\nprefill: 3\n"
    )
    spec, _ = launch.parse_spec(["--config", str(config), "--max-inflight", "9"])
    c = launch.Cluster(spec)
    assert spec.engine.scheduler.max_num_seqs == 8 and spec.engine.cache.block_size == 32
    assert spec.num_prefill == 3
    router = c.router_config()
    assert (router.prefix.enabled, router.prefix.prefix_weight) == (False, 2.5)
    assert router.max_inflight == 9  # the flag after --config wins
    assert c.worker_config("decode", 0, ADDRESS).kv_pull_timeout_s == 11.0


@pytest.mark.parametrize("entry", [launch.parse_spec, router_main.parse_config])
def test_unknown_yaml_key_is_refused(entry, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("max_model_len: 512\nmax_modle_len: 1024\n")
    with pytest.raises(SystemExit) as e:
        entry(["--config", str(config)])
    assert e.value.code == 2
    assert "'max_modle_len' is not accepted" in capsys.readouterr().err


def test_a_value_a_config_class_refuses_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        router_main.parse_config(["--max-inflight", "0"])
    assert e.value.code == 2
    assert "max_inflight must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.parse_spec(["--metrics-compat", "sglang"])
    with pytest.raises(SystemExit):  # detached workers need a Ray cluster
        launch.parse_spec(["--detach-workers"])


def test_one_max_tokens_default():
    defaults = {
        sub: cli.build_parser().parse_args([sub, "x"] if sub == "generate" else [sub]).max_tokens
        for sub in ("generate", "chat")
    }
    assert defaults == {"generate": cli.DEFAULT_MAX_TOKENS, "chat": cli.DEFAULT_MAX_TOKENS}
    assert launch.LaunchOptions().max_tokens == cli.DEFAULT_MAX_TOKENS


def test_one_kv_cache_and_disaggregation_default():
    assert EngineConfig().cache.kv_cache_bytes == 1 * GiB
    assert launch.ClusterSpec().disagg_min_prompt_tokens == RouterConfig().disagg_min_prompt_tokens


def test_client_path_does_not_load_the_settings_library():
    code = (
        "import sys, pagedserve.router.client, pagedserve.cli\n"
        "print(sorted(m for m in ('jsonargparse', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


# -- the generic mechanism: fields other engineers add ----------------------------------


@dataclass(frozen=True)
class Files:
    certfile: str
    keyfile: str
    ca_certs: str | None = None


@dataclass(frozen=True)
class Server:
    port: int = 1  # the port
    internal_tls: Files | None = None  # an optional nested dataclass: flattened
    trusted_peers: bool = False


def test_new_fields_need_no_schema_code_and_optional_dataclasses_flatten(capsys):
    schema = Schema("srv", "a server", [Root("server", Server)], version="9")
    flags = {f for s in schema.settings for f in s.flags}
    assert flags == {
        "--port",
        "--internal-tls-certfile",
        "--internal-tls-keyfile",
        "--internal-tls-ca-certs",
        "--trusted-peers",
    }
    parser = schema.parser()

    def build(argv: list[str]) -> Server:
        return schema.build(parser.parse_args(argv), parser)["server"]

    assert build([]) == Server()
    assert build(["--internal-tls-certfile", "c", "--internal-tls-keyfile", "k"]) == Server(
        internal_tls=Files("c", "k")
    )
    with pytest.raises(SystemExit):  # the keyfile is missing: the class says so
        build(["--internal-tls-certfile", "c"])
    assert "keyfile" in capsys.readouterr().err


def test_the_alias_table_names_an_optional_dataclass(monkeypatch):
    monkeypatch.setitem(settings.NESTED_PREFIX, "Server.internal_tls", "internal-ssl-")
    schema = Schema("srv", "a server", [Root("server", Server)], version="9")
    assert schema.setting("internal_ssl_ca_certs").path == ("internal_tls", "ca_certs")


def test_two_fields_on_one_flag_is_an_error():
    @dataclass(frozen=True)
    class Other:
        port: int = 2

    with pytest.raises(SchemaError, match="--port"):
        Schema("x", "", [Root("a", Server), Root("b", Other)], version="9")
    # Unless it is linked to the first root's field of that name (as ClusterSpec's
    # redis_url is to the router's and the workers').
    Schema("x", "", [Root("a", Server), Root("b", Other, partial=True)], version="9")


def test_linked_optional_dataclass_fields_stay_unset_in_the_other_roots():
    """ClusterSpec's `internal_tls` (an `X | None` with flags) is linked to the router's
    and the workers' field of the same name: their partial roots must not carry a None
    of their own for it (it would override the spec's value)."""
    spec, _ = launch.parse_spec([])
    for options in (spec.router_options, spec.worker_options):
        assert not {"public_tls", "internal_tls"} & set(options)
