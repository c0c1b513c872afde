#!/usr/bin/env python3
"""Proves that check_deploy.py catches what it claims to: each case breaks one file of a
temporary copy of the repository's deploy/ (and scripts/) and expects the named check to
fail with a given message; the unbroken copy must pass.

    tests/deploy/check_deploy_selftest.py --root REPO [--kvtierd PATH] [--kvtier-run PATH]

Cases that need a binary run only when it is given. Exit status: 0 when every case behaved,
1 when one did not, 77 (ctest SKIP_RETURN_CODE) when the unbroken copy's checks skip for a
missing tool (never with CI=true, where those checks fail instead). Standard library, plus
what check_deploy.py needs.
"""

import argparse
import contextlib
import io
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "check_deploy.py")
sys.path.insert(0, HERE)
import check_deploy  # noqa: E402


def sub(pattern, replacement, count=1):
    """A transform: re.sub on the file's text; it must change something."""
    def apply(text):
        out, n = re.subn(pattern, replacement, text, count=count, flags=re.M)
        if n == 0:
            raise AssertionError("pattern %r not found" % pattern)
        return out
    return apply


def append(extra):
    return lambda text: text + extra


# (name, check, file, transform, expected message (regex), needs: the binaries the case
# needs given, or "apt-lists" for Debian's package lists on this machine)
CASES = [
    # yaml
    ("duplicate key", "yaml", "deploy/compose.yaml",
     sub(r"^(    image: kvtier:local)$", r"\1\n    image: kvtier:other"),
     r"duplicate key 'image'", ()),
    ("YAML syntax", "yaml", "deploy/prometheus.yml",
     sub(r'targets: \["kvtierd:9464"\]', 'targets: ["kvtierd:9464"'), r"prometheus.yml: ", ()),
    ("JSON syntax", "yaml", "deploy/grafana/kvtier-dashboard.json",
     sub(r'"schemaVersion": 39,', '"schemaVersion": 39,,'), r"kvtier-dashboard.json: ", ()),
    # k8s: schema
    ("k8s unknown field", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"imagePullPolicy: IfNotPresent", "imagePullPolicyy: IfNotPresent"),
     r"'imagePullPolicyy' was unexpected", ()),
    ("k8s wrong type", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"containerPort: 9464", 'containerPort: "9464"'),
     r"containerPort: '9464' is not of type", ()),
    ("k8s required field", "k8s", "deploy/k8s/service.yaml",
     sub(r"^      port: 9464\n", ""), r"'port' is a required property", ()),
    ("k8s misplaced field", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"^(      terminationGracePeriodSeconds: 30)$", r"\1\n      replicas: 2"),
     r"'replicas' was unexpected", ()),
    ("k8s unknown kind", "k8s", "deploy/k8s/namespace.yaml",
     sub(r"^apiVersion: v1$", "apiVersion: v2"),
     r"no Kubernetes .* schema for apiVersion 'v2'", ()),
    # k8s: consistency
    ("k8s no IPC_LOCK", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r'add: \["IPC_LOCK"\]', 'add: ["SYS_NICE"]'), r"does not add IPC_LOCK", ()),
    ("k8s hostPath", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"path: /run/kvtier$", "path: /run/kvtier2"), r"is not the hostPath /run/kvtier", ()),
    ("k8s hugepages", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"medium: HugePages-2Mi", "medium: Memory"), r"HugePages-2Mi", ()),
    ("k8s probe", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r'(livenessProbe:\n            exec:\n              command: \["kvtierctl", )"health"',
         r'\1"status"'), r"livenessProbe runs", ()),
    ("k8s kustomization", "k8s", "deploy/k8s/kustomization.yaml",
     sub(r"^  - service.yaml\n", ""), r"kustomization.yaml: resources", ()),
    ("k8s GPU nodes", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r"nvidia.com/gpu.present", "example.com/gpu"), r"not restricted to GPU nodes", ()),
    ("k8s metrics annotation", "k8s", "deploy/k8s/daemonset.yaml",
     sub(r'prometheus.io/port: "9464"', 'prometheus.io/port: "9465"'), r"prometheus.io/port", ()),
    ("k8s service selector", "k8s", "deploy/k8s/service.yaml",
     sub(r"^(  selector:\n    app.kubernetes.io/name: )kvtierd", r"\1kvtier"),
     r"selector does not match", ()),
    ("k8s engine pod", "k8s", "deploy/k8s/engine-pod.example.yaml",
     sub(r"mountPath: /run/kvtier", "mountPath: /var/run/kvtier"),
     r"does not mount the node's /run/kvtier", ()),
    # compose
    ("compose unknown key", "compose", "deploy/compose.yaml",
     sub(r"^    shm_size: 256m$", "    shm_size: 256m\n    ulimit: {}"),
     r"services/kvtierd: 'ulimit'", ()),
    ("compose wrong type", "compose", "deploy/compose.yaml",
     sub(r"^      retries: 3$", "      retries: [3]"), r"healthcheck/retries", ()),
    ("compose memlock", "compose", "deploy/compose.yaml",
     sub(r"memlock: -1", "memlock: 65536"), r"memlock is not -1", ()),
    ("compose healthcheck", "compose", "deploy/compose.yaml",
     sub(r'test: \["CMD", "kvtierctl", "health"', 'test: ["CMD", "kvtierctl", "ping"'),
     r"healthcheck .* is not the Dockerfile's HEALTHCHECK", ()),
    ("compose socket volume", "compose", "deploy/compose.yaml",
     sub(r"^      - kvtier-run:/run/kvtier$", "      - kvtier-run:/run/kvtierd"),
     r"does not mount a named volume at /run/kvtier", ()),
    ("compose prometheus target", "compose", "deploy/prometheus.yml",
     sub(r"kvtierd:9464", "kvtier:9464"), r"kvtier is not a compose service", ()),
    ("compose grafana datasource", "compose",
     "deploy/grafana/provisioning/datasources/prometheus.yaml",
     sub(r"http://prometheus:9090", "http://prom:9090"), r"no prometheus data source", ()),
    # prometheus
    ("promtool config", "prometheus", "deploy/prometheus.yml",
     sub(r"^    scrape_timeout: 4s$", "    scrape_timeout: 4x"), r"promtool check config", ()),
    ("prometheus port", "prometheus", "deploy/prometheus.yml",
     sub(r"kvtierd:9464", "kvtierd:9465"),
     r"port 9465 is not the configuration's metrics port", ()),
    ("prometheus interval", "prometheus", "deploy/prometheus.yml",
     sub(r"^    scrape_interval: 5s$", "    scrape_interval: 15s"), r"every 15s, not 5s", ()),
    # dashboard
    ("dashboard unknown metric", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r"sum\(kvtier_rpcs_in_flight\)", "sum(kvtier_rpcs_inflight)"),
     r"kvtier_rpcs_inflight, which is not in the metrics contract", ()),
    ("dashboard PromQL syntax", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r"sum\(kvtier_rpcs_in_flight\)", "sum(kvtier_rpcs_in_flight"),
     r"promtool check rules", ()),
    ("dashboard undefined variable", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r"sum\(kvtier_rpcs_in_flight\)", 'sum(kvtier_rpcs_in_flight{method=~\\\\"$method\\\\"})'),
     r"undefined variable \$method", ()),
    ("dashboard schemaVersion", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r'"schemaVersion": 39', '"schemaVersion": 30'), r"schemaVersion 30 < 36", ()),
    ("dashboard overlap", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r'"x": 12,\n(\s*)"y": 1', r'"x": 6,\n\1"y": 1'), r"overlaps", ()),
    ("dashboard tenant variable", "dashboard", "deploy/grafana/kvtier-dashboard.json",
     sub(r'"label_values\(kvtier_tenant_quota_bytes, tenant\)"',
         '"label_values(kvtier_tenant_quota_bytes, tenants)"', count=0),
     r"no tenant variable", ()),
    # dockerfile
    ("dockerfile no scripts/build", "dockerfile", "deploy/Dockerfile",
     sub(r"bash scripts/build \\", r"cmake -S . -B build \\"),
     r"does not run `bash scripts/build`", ()),
    ("dockerfile no scripts/setup", "dockerfile", "deploy/Dockerfile",
     sub(r"RUN bash scripts/setup --build-only", "RUN apt-get update"),
     r"does not run `bash scripts/setup`", ()),
    ("dockerfile no kvtierctl", "dockerfile", "deploy/Dockerfile",
     sub(r"^(COPY --from=build /stage/usr/local/bin/kvtierd) /stage/usr/local/bin/kvtierctl",
         r"\1"), r"does not copy kvtierctl", ()),
    ("dockerfile missing source", "dockerfile", "deploy/Dockerfile",
     sub(r"COPY deploy/kvtierd.container.toml", "COPY deploy/kvtierd.toml"),
     r"COPY deploy/kvtierd.toml: no such file", ()),
    ("dockerfile ignored source", "dockerfile", "deploy/Dockerfile.dockerignore",
     append("/scripts\n"), r"leaves out scripts/setup", ()),
    ("dockerfile root user", "dockerfile", "deploy/Dockerfile",
     sub(r"^USER kvtier$", "USER root"), r"runs as root", ()),
    ("dockerfile entrypoint", "dockerfile", "deploy/Dockerfile",
     sub(r'"--config", "/etc/kvtier/kvtierd.toml"\]', '"--config", "/etc/kvtierd.toml"]'),
     r"ENTRYPOINT is not", ()),
    ("scripts/test builds itself", "dockerfile", "scripts/test",
     sub(r"^bash scripts/build .*$", 'cmake --build "$BUILD_DIR"'),
     r"scripts/test does not run scripts/build", ()),
    ("dockerfile unknown package", "dockerfile", "deploy/Dockerfile",
     sub(r" libspdlog1\.10 ", " libspdlog1.99 "), r"installs libspdlog1\.99, which", ("apt-lists",)),
    ("dockerfile runtime library", "dockerfile", "deploy/Dockerfile",
     sub(r" libspdlog1\.10 ", " "), r"does not install libspdlog1\.10", ("kvtierd",)),
    # config
    ("config ConfigMap differs", "config", "deploy/k8s/configmap.yaml",
     sub(r"host_memory_bytes = 4_294_967_296", "host_memory_bytes = 8_589_934_592"),
     r"kvtierd.toml differs from deploy/kvtierd.container.toml", ()),
    ("config allow_remote", "config", "deploy/kvtierd.container.toml",
     sub(r"^allow_remote = true$", "allow_remote = false"), r"allow_remote is not true", ()),
    ("config rejected by kvtierd", "config", "deploy/kvtierd.container.toml",
     sub(r"^shm = true$", "shm = true\nshm_size = 1"), r"--check-config: exit 2", ("kvtierd",)),
]


def make_copy(root, tmp):
    """A copy of what the checks read: deploy/, scripts/ and CMakeLists.txt copied (the
    cases edit them), the rest of the top level linked, tests/deploy/schemas rebuilt with
    its node_modules linked."""
    for entry in os.listdir(root):
        if entry in (".git", "tests") or entry.startswith("build"):
            continue
        src = os.path.join(root, entry)
        dst = os.path.join(tmp, entry)
        if entry in ("deploy", "scripts"):
            shutil.copytree(src, dst, symlinks=True)
        elif os.path.isfile(src):
            shutil.copy2(src, dst)
        else:
            os.symlink(src, dst)
    schemas = os.path.join(tmp, "tests", "deploy", "schemas")
    os.makedirs(schemas)
    src_schemas = os.path.join(root, "tests", "deploy", "schemas")
    for f in ("package.json", "package-lock.json"):
        shutil.copy2(os.path.join(src_schemas, f), schemas)
    if os.path.isdir(os.path.join(src_schemas, "node_modules")):
        os.symlink(os.path.join(src_schemas, "node_modules"), os.path.join(schemas, "node_modules"))


def run_checker(root, check, binaries):
    """(exit status, output) of check_deploy.py on `root`, run in this process."""
    argv = [CHECKER, "--root", root, "--check", check]
    for name, path in binaries.items():
        if path:
            argv += ["--" + name, path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = check_deploy.main(argv)
    return code, out.getvalue()


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--kvtierd")
    parser.add_argument("--kvtier-run", dest="kvtier_run")
    parser.add_argument("--case", action="append", help="run only the cases named so")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print what the checker said for each case")
    args = parser.parse_args(argv[1:])
    root = os.path.abspath(args.root)
    binaries = {"kvtierd": args.kvtierd, "kvtier-run": args.kvtier_run}
    bad, skipped, ran = [], [], 0
    with tempfile.TemporaryDirectory(prefix="kvtier-deploy-selftest-") as tmp:
        clean = os.path.join(tmp, "clean")
        os.makedirs(clean)
        make_copy(root, clean)
        checks = sorted({c[1] for c in CASES})
        missing_tools = []
        for check in checks:
            code, out = run_checker(clean, check, binaries)
            if code == 77:
                missing_tools.append(out.strip())
            elif code != 0:
                bad.append("the unbroken copy fails check %s:\n%s" % (check, out))
        if missing_tools and not bad:
            # The cases expect each check's full verdict, tools included.
            print("check_deploy selftest: skipped, the checks lack tools:\n  "
                  + "\n  ".join(missing_tools))
            return 77
        for name, check, rel, transform, expected, needs in CASES:
            if args.case and name not in args.case:
                continue
            if "apt-lists" in needs and not check_deploy.apt_lists_present():
                skipped.append("%s (needs Debian's package lists)" % name)
                continue
            if any(not binaries.get(n) for n in needs if n != "apt-lists"):
                skipped.append("%s (needs --%s)" % (name, " --".join(needs)))
                continue
            work = os.path.join(tmp, "case")
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            make_copy(root, work)
            path = os.path.join(work, rel)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            try:
                broken = transform(text)
            except AssertionError as e:
                bad.append("%s: cannot break %s: %s" % (name, rel, e))
                continue
            with open(path, "w", encoding="utf-8") as f:
                f.write(broken)
            code, out = run_checker(work, check, binaries)
            ran += 1
            if args.verbose:
                print("== %s (%s, check %s): exit %d\n%s" % (name, rel, check, code, out))
            if code != 1 or not re.search(expected, out):
                bad.append("%s: breaking %s: check %s exited %d, expected 1 and /%s/:\n%s"
                           % (name, rel, check, code, expected, out))
        # health: the daemon side with stand-ins for kvtierctl, one answering SERVING (exit 0),
        # one not (exit 1); the real kvtierctl runs in the deploy_health test.
        if binaries["kvtierd"] and (not args.case or "health" in args.case):
            for code_wanted, status in ((0, 0), (1, 1)):
                fake = os.path.join(tmp, "kvtierctl-exit-%d" % status)
                with open(fake, "w", encoding="utf-8") as f:
                    f.write("#!/bin/sh\nexit %d\n" % status)
                os.chmod(fake, 0o755)
                code, out = run_checker(clean, "health", dict(binaries, kvtierctl=fake))
                ran += 1
                if args.verbose:
                    print("== health with a kvtierctl exiting %d: exit %d\n%s"
                          % (status, code, out))
                if code != code_wanted or (status and not re.search(
                        r"exited 1 against a running kvtierd", out)):
                    bad.append("health with a kvtierctl exiting %d: check exited %d, expected "
                               "%d:\n%s" % (status, code, code_wanted, out))
        elif not binaries["kvtierd"]:
            skipped.append("health (needs --kvtierd)")
    for b in bad:
        print("FAIL " + b)
    for s in skipped:
        print("skipped: " + s)
    print("check_deploy selftest: %d cases run, %d misbehaved, %d skipped"
          % (ran, len(bad), len(skipped)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
