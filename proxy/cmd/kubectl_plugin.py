"""`kubectl sliceproxy ...`: sliceproxy as a kubectl plugin (the `kubectl-sliceproxy`
executable this package installs; kubectl runs any `kubectl-<name>` on PATH).

    kubectl sliceproxy explain --node NODE [--service NS/NAME] [-o table|json]
        what sliceproxy does on NODE with the cluster kubectl is pointed at: the plugin
        runs `kubectl get services,endpointslices,nodes -A -o yaml` (with the
        --kubeconfig and --context given here, else kubectl's own) and explains it;
        with FILE arguments or `-`, those instead, as `python -m proxy explain`
    kubectl sliceproxy dump [ADDRESS] [--service NS/NAME] [-o table|json]
        ask a running agent (its /debug/dump), as `python -m proxy dump`

As kubectl's plugins do, it takes its arguments as given (kubectl's own flags such as
--context are not passed to plugins, so it reads them itself) and writes errors to
stderr with a non-zero exit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from proxy.cmd import dump_client, explain

PROG = "kubectl sliceproxy"
# What kubectl needs to know which cluster: taken out of explain's arguments.
KUBECTL_FLAGS = ("--kubeconfig", "--context", "--cluster", "--user", "--server")
USAGE = __doc__.split("\n\n", 1)[1].split("\n\nAs kubectl", 1)[0]


def _kubectl_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(kubectl's connection flags, the rest) from `argv`."""
    ours: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in KUBECTL_FLAGS:
            if "=" in arg:
                ours.append(arg)
            elif i + 1 < len(argv):
                ours += [arg, argv[i + 1]]
                i += 1
            else:
                ours.append(arg)  # kubectl says what is missing
        else:
            rest.append(arg)
        i += 1
    return ours, rest


def cluster_objects(kubectl_flags: list[str], endpoints: bool) -> str:
    """What `kubectl get` prints for the objects explain reads (RuntimeError if not)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not on PATH")
    kinds = "services,endpoints,nodes" if endpoints else \
        "services,endpointslices.discovery.k8s.io,nodes"
    proc = subprocess.run([kubectl, *kubectl_flags, "get", kinds, "--all-namespaces",
                           "-o", "yaml"], capture_output=True, text=True, timeout=120,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl get {kinds} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _explain(argv: list[str]) -> int:
    flags, rest = _kubectl_flags(argv)
    parsed, _unknown = explain.build_parser().parse_known_args(rest)
    if parsed.files or parsed.filename or "-h" in rest or "--help" in rest:
        return explain.main(rest, prog=f"{PROG} explain")
    try:
        text = cluster_objects(flags, parsed.endpoints_source == "endpoints")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG} explain: {exc}", file=sys.stderr)
        return 1
    return explain.main(rest, stdin=text, prog=f"{PROG} explain")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(f"usage:\n{USAGE}")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "explain":
        return _explain(rest)
    if command == "dump":
        return dump_client.main(rest, prog=f"{PROG} dump")
    print(f"{PROG}: unknown command {command!r} (explain, dump; --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
