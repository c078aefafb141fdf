"""One settings schema for every entry point, derived from the config dataclasses.

Every setting is declared once, as a field of a config dataclass (EngineConfig and its
CacheConfig / SchedulerConfig, RouterConfig, WorkerConfig, ClusterSpec) with its
default and a comment. An entry point (`pagedserve up`, `python -m pagedserve.router`)
lists the dataclasses it takes (`Root`s); `Schema` walks their fields, nested
dataclasses included, and turns each leaf field into one flag of a jsonargparse parser:
typed from the field's annotation, the default taken from the field, the help text
from the field's comment, `--help` showing every default, `--config FILE.yaml` and
`--version`. A field someone adds to a dataclass is a flag at the next start: nothing
here needs to change.

How a field becomes a flag (all of it decided by the tables below, in this one place):

- Its name: `--` + the field name in kebab case (`max_num_seqs` -> `--max-num-seqs`),
  unless FLAG_NAMES gives one (vLLM's name where the meaning is the same, or the
  name the flag had before this schema); further names there are aliases, so a
  renamed flag keeps its old spelling. The flag's `dest` (also its YAML key) is the
  first name in snake case.
- Nested dataclasses are flattened: their fields become flags of the parent, under
  the prefix NESTED_PREFIX gives the nested field ("" when none: EngineConfig.cache's
  `block_size` is just `--block-size`). A field typed `X | None` where X is a
  dataclass (`TLSFiles | None`: three paths) flattens the same way, with the prefix
  `<field>-` unless NESTED_PREFIX says otherwise (`internal_tls` -> `--internal-ssl-
  certfile`, `--internal-ssl-keyfile`, `--internal-ssl-ca-certs`); the field is None
  when none of X's flags is given, else X(**the given ones) (X's own checks then name
  what is missing).
- A bool is a pair `--flag` / `--no-flag`.
- NOT_FLAGS lists the fields that are never flags (values the launcher derives per
  worker, escape hatches for code), each with its reason; an entry point's `links`
  (field -> the setting that sets it there) mark a field set from another entry's
  setting (the launcher passes `--max-model-len` to both the engine and the router).
- UNIT_FLAGS adds a second spelling in another unit (`--kv-cache-gib` for
  `--kv-cache-memory-bytes`); ENV_VARS names environment variables read when the
  flag is not given.

Two fields of one entry point that land on the same flag name are an error when the
parser is built (tests/test_config_schema.py builds them all), never a silent
rename: give one of them a name in FLAG_NAMES, or a link.

A YAML `--config` file is flat, keyed by the flags' names in snake case (as vLLM's
`--config`): `max_model_len: 4096`, `no_prefix_routing` is `prefix_routing: false`.
Unknown keys are refused. Command-line flags given after `--config` win over it.

This module knows no config class (it only reads the ones it is given), so that the
router's entry point can use it without the engine: `common/api` is torch-free.
jsonargparse is imported here only; the client and the `generate`/`chat` commands
never import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, DefaultHelpFormatter
from jsonargparse import Namespace as ParsedArgs

GiB = 1 << 30

# "Class.field" -> the flag's names: the first is its name, the rest aliases (old
# spellings that keep working). vLLM's names where the meaning is the same.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    # ClusterSpec (`pagedserve up`): the names the launcher has always used.
    "ClusterSpec.num_prefill": ("--prefill",),
    "ClusterSpec.num_decode": ("--decode",),
    "ClusterSpec.router_host": ("--host",),
    "ClusterSpec.router_port": ("--port",),
    "ClusterSpec.router_advertise_host": ("--advertise-host",),
    "ClusterSpec.router_metrics_port": ("--metrics-port",),
    "ClusterSpec.router_http_port": ("--http-port",),  # RouterConfig.http_port's flag
    # EngineConfig: vLLM's `--kv-cache-memory-bytes`; threads per worker as before.
    "EngineConfig.num_threads": ("--threads-per-worker",),
    "CacheConfig.kv_cache_bytes": ("--kv-cache-memory-bytes",),
    # RouterConfig.prefix (PrefixRouting): the standalone router's names so far.
    "PrefixRouting.enabled": ("--prefix-routing",),  # --no-prefix-routing: load only
    "PrefixRouting.pull": ("--prefix-pull",),  # --no-prefix-pull
    "PrefixRouting.prefix_weight": ("--prefix-weight",),
    "PrefixRouting.load_weight": ("--prefix-load-weight",),
    "PrefixRouting.prefill_tokens_per_s": ("--prefill-tokens-per-s",),
    "PrefixRouting.transfer_bytes_per_s": ("--transfer-bytes-per-s",),
    # WorkerConfig fields whose names the router's own settings already take in
    # `pagedserve up` (the same word, another meaning: the worker's side of the call).
    "WorkerConfig.release_lease_timeout_s": ("--worker-release-lease-timeout-s",),
    "WorkerConfig.transfer_failure_policy": ("--worker-transfer-failure-policy",),
}

# "Class.field" of a nested dataclass -> the prefix of its fields' flags. Not listed:
# "" for a required nested dataclass, "<field>-" for an optional one (`X | None`).
NESTED_PREFIX: dict[str, str] = {
    "RouterConfig.prefix": "prefix-",
    "RouterConfig.load_weights": "load-weight-",
    # TLS files (issue 11), spelled as vLLM/uvicorn do: --ssl-certfile, ...
    "RouterConfig.public_tls": "ssl-",
    "RouterConfig.internal_tls": "internal-ssl-",
    "WorkerConfig.internal_tls": "internal-ssl-",
    "ClusterSpec.public_tls": "ssl-",
    "ClusterSpec.internal_tls": "internal-ssl-",
}

# Fields that are no flag anywhere, and why. (Engine internals derived from other
# settings are properties, not fields, so they need no entry.)
NOT_FLAGS: dict[str, str] = {
    "ClusterSpec.router_options": "filled from the router's own settings (RouterConfig)",
    "ClusterSpec.worker_options": "filled from the workers' own settings (WorkerConfig)",
    "WorkerConfig.worker_id": "the launcher names each worker (prefill-0, decode-0, ...)",
    "WorkerConfig.pool": "the launcher sets it per worker (--prefill / --decode)",
    "WorkerConfig.port": "the launcher sets it per worker from --worker-port (default: any free port)",
    "WorkerConfig.advertise_host": "derived from --listen-host (0.0.0.0: the node's IP)",
    "WorkerConfig.registry_address": "the launcher's router (--advertise-host, --port)",
    "WorkerConfig.index_address": "the launcher's router, unless --redis-url",
    "WorkerConfig.trusted_peers": "for workers run without a registry (embedded, tests); "
    "the launcher's workers learn their peers from the router's heartbeat answers",
}

# "Class.field" -> (flag, unit size, unit name): a second flag in another unit, a float; given, it
# wins over the field's own flag.
UNIT_FLAGS: dict[str, tuple[str, int, str]] = {
    "CacheConfig.kv_cache_bytes": ("--kv-cache-gib", GiB, "GiB"),
}

# "Class.field" -> its default on the command lines, where it differs from the
# dataclass's. The OpenAI-compatible HTTP API is on by default for `pagedserve up` and
# `python -m pagedserve.router` (port 8000, as `vllm serve`), while a router built in
# code (tests, embedding) binds no HTTP port unless asked: two of them in one process
# would collide on a fixed port. `--no-http` (OFF_FLAGS) turns it off.
CLI_DEFAULTS: dict[str, Any] = {
    "RouterConfig.http_port": 8000,
    # The internal listener: workers started on their own and `pagedserve status` dial
    # a fixed port (RouterConfig's 0 keeps routers built in code apart).
    "RouterConfig.internal_port": 50052,
    "ClusterSpec.router_http_port": 8000,
}

# "Class.field" -> (flag, help): a second flag that sets an `X | None` field to None
# (off) whatever its own flag says, for fields whose command-line default is on.
_HTTP_OFF = ("--no-http", "do not serve the OpenAI-compatible HTTP API (--http-port)")
OFF_FLAGS: dict[str, tuple[str, str]] = {
    "RouterConfig.http_port": _HTTP_OFF,
    "ClusterSpec.router_http_port": _HTTP_OFF,
}

# "Class.field" -> an environment variable read when the flag is not given (as
# `vllm serve --api-key` reads VLLM_API_KEY). Never shown as a default in --help.
ENV_VARS: dict[str, str] = {
    "RouterConfig.api_key": "PAGEDSERVE_API_KEY",
    "RouterConfig.api_keys_file": "PAGEDSERVE_API_KEYS_FILE",
}


class SchemaError(Exception):
    """The config dataclasses and the tables above do not make a consistent CLI."""


@dataclass(frozen=True)
class Root:
    """A config dataclass an entry point takes, built into `name` of the result.

    `partial`: the entry point sets some of its fields itself (links), so the result
    is a dict of the other top-level fields (kwargs for the class), not an instance.
    """

    name: str
    cls: type
    partial: bool = False


@dataclass(frozen=True)
class Setting:
    """One flag: where it goes (root, field path) and how it parses."""

    dest: str  # also the YAML key
    flags: tuple[str, ...]
    root: str
    path: tuple[str, ...]  # field names from the root's class down to the leaf
    key: str  # "Class.field" of the leaf
    type: Any
    default: Any
    help: str
    optional_group: tuple[str, ...] | None = None  # path of an `X | None` dataclass above


@dataclass(frozen=True)
class Link:
    """A field an entry point does not take as a flag, because it sets it from another
    setting (`source`: a field path in the first root)."""

    root: str
    path: tuple[str, ...]
    key: str
    source: tuple[str, ...]


@dataclass
class Schema:
    """The settings of one entry point: parser, and parsed flags -> config objects.

    `links`: "Class.field" -> a field path in the first root ("engine.max_n") that
    sets it; besides, a top-level field of a later, partial root named like a
    top-level field of the first root is linked to it (ClusterSpec.redis_url sets the
    router's and the workers' redis_url). The entry point's own code applies the links
    (Cluster.router_config / worker_config); the schema only keeps them off the flags
    and tells the tests where each field's value comes from.
    """

    prog: str
    description: str
    roots: Sequence[Root]
    version: str
    links: Mapping[str, str] = field(default_factory=dict)
    extra: Callable[[ArgumentParser], None] | None = None  # flags that are no field

    def __post_init__(self) -> None:
        self.settings: list[Setting] = []
        self.linked: list[Link] = []
        self.skipped: dict[str, str] = {}  # "Class.field" -> reason (NOT_FLAGS)
        first = self.roots[0]
        first_names = {f.name for f in dataclasses.fields(first.cls)}
        for root in self.roots:
            auto = first_names if root.partial and root is not first else set()
            self._walk(root, root.cls, (), "", auto, None)
        seen: dict[str, Setting] = {}
        for s in self.settings:
            for flag in s.flags:
                other = seen.get(flag)
                if other is not None:
                    raise SchemaError(
                        f"{self.prog}: {s.key} and {other.key} both want the flag {flag}: "
                        "name one of them in settings.FLAG_NAMES, or link it"
                    )
                seen[flag] = s
        self._by_dest = {s.dest: s for s in self.settings}

    # -- walking the dataclasses ----------------------------------------------------

    def _walk(
        self,
        root: Root,
        cls: type,
        path: tuple[str, ...],
        prefix: str,
        auto_links: set[str],
        group: tuple[str, ...] | None,
    ) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{cls.__name__}.{f.name}"
            here = (*path, f.name)
            if key in NOT_FLAGS:
                self.skipped[key] = NOT_FLAGS[key]
                continue
            source = self.links.get(key)
            if source is None and not path and f.name in auto_links:
                source = f.name
            if source is not None:
                self.linked.append(Link(root.name, here, key, tuple(source.split("."))))
                continue
            tp = hints[f.name]
            nested, optional = _nested_dataclass(tp)
            if nested is not None:
                default_prefix = f"{_kebab(f.name)}-" if optional else ""
                sub = prefix + NESTED_PREFIX.get(key, default_prefix)
                self._walk(root, nested, here, sub, set(), here if optional else group)
                continue
            flags = FLAG_NAMES.get(key) or (f"--{prefix}{_kebab(f.name)}",)
            env = ENV_VARS.get(key)
            # The field's name always shows: DefaultHelpFormatter shows no default for a
            # flag without help, and it says which config field the flag sets.
            text = f"{docs.get(f.name, '')} [{key}]".strip()
            if env:
                text = f"{text} (env {env})"
            self.settings.append(
                Setting(
                    dest=_dest(flags[0]),
                    flags=flags,
                    root=root.name,
                    path=here,
                    key=key,
                    type=tp,
                    default=None if group is not None else CLI_DEFAULTS.get(key, _field_default(f)),
                    help=text,
                    optional_group=group,
                )
            )

    # -- the parser -----------------------------------------------------------------

    def parser(self) -> ArgumentParser:
        p = ArgumentParser(
            prog=self.prog,
            description=self.description,
            formatter_class=DefaultHelpFormatter,
            exit_on_error=True,
        )
        p.add_argument(
            "--config",
            action=ActionConfigFile,
            help="a YAML file of settings, keyed by the flags' names in snake case "
            "(max_model_len: 4096); flags after it override it",
        )
        p.add_argument("--version", action="version", version=f"%(prog)s {self.version}")
        if self.extra is not None:
            self.extra(p)
        for s in self.settings:
            self._add(p, s)
        return p

    def _add(self, p: ArgumentParser, s: Setting) -> None:
        if s.type is bool:
            p.add_argument(
                s.flags[0],
                action=ActionYesNo(no_prefix="no-"),
                dest=s.dest,
                default=s.default,
                help=s.help,
            )
        else:
            tp = s.type if s.optional_group is None else s.type | None
            p.add_argument(*s.flags, dest=s.dest, type=tp, default=s.default, help=s.help)
        off = OFF_FLAGS.get(s.key)
        if off is not None:
            p.add_argument(off[0], action="store_true", default=False, help=off[1])
        unit = UNIT_FLAGS.get(s.key)
        if unit is not None:
            flag, _size, name = unit
            p.add_argument(
                flag,
                type=float | None,
                default=None,
                help=f"{s.flags[0]} in {name}; wins over it",
            )

    # -- parsed flags -> config objects ---------------------------------------------

    def parse(self, argv: Sequence[str] | None = None) -> ParsedArgs:
        return self.parser().parse_args(argv)

    def build(self, args: ParsedArgs, parser: ArgumentParser | None = None) -> dict[str, Any]:
        """Root name -> its instance (or kwargs, for a partial root).

        A value a config class refuses (its __post_init__) is a parser error (exit 2,
        the class's message) when `parser` is given, else raised.
        """
        values: dict[str, dict[tuple[str, ...], Any]] = {r.name: {} for r in self.roots}
        for s in self.settings:
            value = self._value(args, s)
            if s.optional_group is not None and value is None:
                continue
            values[s.root][s.path] = value
        try:
            return {r.name: self._construct(r, values[r.name]) for r in self.roots}
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            if parser is None:
                raise
            parser.error(str(e))
            raise  # unreachable: error() exits

    def _value(self, args: ParsedArgs, s: Setting) -> Any:
        value = args[s.dest]
        unit = UNIT_FLAGS.get(s.key)
        if unit is not None:
            given = args[_dest(unit[0])]
            if given is not None:
                value = int(given * unit[1])
        off = OFF_FLAGS.get(s.key)
        if off is not None and args[_dest(off[0])]:
            value = None
        env = ENV_VARS.get(s.key)
        if env is not None and value == s.default and os.environ.get(env):
            value = os.environ[env]
        return value

    def _construct(self, root: Root, values: dict[tuple[str, ...], Any]) -> Any:
        kwargs = _build_kwargs(root.cls, (), values, self.optional_groups(root.name))
        return kwargs if root.partial else root.cls(**kwargs)

    def optional_groups(self, root: str | None = None) -> set[tuple[str, ...]]:
        """The `X | None` dataclass fields with flags (of `root` only, when given: paths
        are relative to their root, and another root's linked field of the same name
        must stay unset, not become None)."""
        return {
            s.optional_group
            for s in self.settings
            if s.optional_group is not None and root in (None, s.root)
        }

    # -- for tests and docs ---------------------------------------------------------

    def setting(self, dest: str) -> Setting:
        return self._by_dest[dest]

    def setting_at(self, root: str, path: Sequence[str]) -> Setting | None:
        """The setting whose field is `path` in `root` (None: a link or not a flag)."""
        for s in self.settings:
            if s.root == root and s.path == tuple(path):
                return s
        return None


def leaf_fields(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """(field path, "Class.field") of every leaf field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested, _ = _nested_dataclass(hints[f.name])
        key = f"{cls.__name__}.{f.name}"
        if nested is not None and key not in NOT_FLAGS:
            yield from leaf_fields(nested, (*path, f.name))
        else:
            yield (*path, f.name), key


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class body: the comment lines right above it
    and the one at its end, joined ("# -- section --" lines are headings, skipped).

    Read once per class and process (the source does not change under a running
    process; reading and tokenizing it was about half of every `parse_spec`), handed
    out as a copy so that no caller can change another's."""
    return dict(_field_comments(cls))


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        m = re.match(r"    (\w+)\s*:", line)
        if m is None or m.group(1) not in names:
            continue
        above: list[str] = []
        j = number - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        parts = [*above, comments.get(number, "")]
        docs[m.group(1)] = " ".join(p for p in parts if p and not p.startswith("--"))
    return docs


def _dest(flag: str) -> str:
    """A flag's dest (and YAML key): `--kv-cache-gib` -> `kv_cache_gib`."""
    return flag.lstrip("-").replace("-", "_")


def _build_kwargs(
    cls: type,
    path: tuple[str, ...],
    values: dict[tuple[str, ...], Any],
    groups: set[tuple[str, ...]],
) -> dict[str, Any]:
    """kwargs for `cls` at `path`: leaf values given, nested dataclasses built; fields
    with no value (links, NOT_FLAGS) are left to the caller or the field's default."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if here in values:
            out[f.name] = values[here]
            continue
        nested, optional = _nested_dataclass(hints[f.name])
        if nested is None:  # a leaf with no value: linked, or not a flag
            continue
        below = {p: v for p, v in values.items() if p[: len(here)] == here}
        if not below:  # linked (set by the caller), or an `X | None` none of whose flags came
            if optional and here in groups:
                out[f.name] = None
            continue
        sub = _build_kwargs(nested, here, values, groups)
        try:
            out[f.name] = nested(**sub)
        except TypeError as e:
            given = ", ".join(".".join(p) for p in below)
            raise TypeError(f"{'.'.join(here)}: {e} (given: {given})") from e
    return out


def _nested_dataclass(tp: Any) -> tuple[type | None, bool]:
    """(X, optional) when `tp` is a dataclass X or `X | None`; (None, False) otherwise."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if (
            len(args) == 1
            and len(typing.get_args(tp)) == 2
            and isinstance(args[0], type)
            and dataclasses.is_dataclass(args[0])
        ):
            return args[0], True
    return None, False


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise SchemaError(
        f"field {f.name} has no default: a flag needs one (or list it in settings.NOT_FLAGS)"
    )


def _kebab(name: str) -> str:
    return name.replace("_", "-")


# `pagedserve up`: fields of the router's and the workers' configs that the launcher
# sets from another setting ("Class.field" -> a field path in ClusterSpec), besides the
# fields named like a ClusterSpec field (redis_url, lease_ttl_s, ...), linked by name.
LAUNCHER_LINKS: dict[str, str] = {
    "EngineConfig.model": "model",  # the workers' engine serves --model
    "RouterConfig.host": "router_host",
    "RouterConfig.port": "router_port",
    "RouterConfig.metrics_port": "router_metrics_port",
    "RouterConfig.http_port": "router_http_port",
    # The router refuses what the workers would refuse: the engine's limits.
    "RouterConfig.max_model_len": "engine.scheduler.max_model_len",
    "RouterConfig.max_n": "engine.max_n",
    "RouterConfig.max_logprobs": "engine.max_logprobs",
    "WorkerConfig.engine": "engine",
    "WorkerConfig.host": "listen_host",
    "WorkerConfig.metrics_port": "worker_metrics_port",  # + k per worker, see ClusterSpec
}
