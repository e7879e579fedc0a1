"""`python -m proxy.sim`: serve the simulator until interrupted.

    python -m proxy.sim --listen 127.0.0.1:0 --kubeconfig-out /tmp/sim.kubeconfig -f examples/
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from proxy.kube.manifests import ManifestError, load_paths
from proxy.sim.errors import ApiError
from proxy.sim.harness import SimServer
from proxy.sim.resources import API_LEVELS, LATEST


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proxy.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 0),
                    help="HOST:PORT to serve on; port 0 picks a free one (default)")
    ap.add_argument("--kubeconfig-out", metavar="FILE", help="write a kubeconfig for clients")
    ap.add_argument("-f", "--filename", action="append", default=[], metavar="PATH",
                    help="manifest file or directory to load at start (repeatable)")
    ap.add_argument("--no-validate", action="store_true",
                    help="store objects even if the real server would reject them")
    ap.add_argument("--bookmark-interval", type=float, default=5.0, metavar="SECONDS",
                    help="how often watches with allowWatchBookmarks get a BOOKMARK")
    ap.add_argument("--history", type=int, default=100_000, metavar="EVENTS",
                    help="watch history kept before older revisions answer 410 Gone")
    ap.add_argument("--api-level", choices=sorted(API_LEVELS), default=LATEST.level,
                    help="Kubernetes release to imitate: 1.20 serves EndpointSlices only as "
                         "discovery.k8s.io/v1beta1 (v1 manifests given with -f are converted)")
    ap.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate "
                    "(the kubeconfig written trusts it as the CA)")
    ap.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    ap.add_argument("--token", help="require this bearer token (written to the kubeconfig)")
    ap.add_argument("--no-watch-cache", action="store_true",
                    help="page resourceVersion=0 lists, as kube-apiserver --watch-cache=false")
    ap.add_argument("--service-cidr", default="198.18.128.0/17")
    ap.add_argument("--service-cidr-v6", default="fd00:198:18::/112")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every request")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    host, port = args.listen
    try:
        objects = load_paths(args.filename)
        sim = SimServer(host=host, port=port, objects=objects, validate=not args.no_validate,
                        bookmark_interval=args.bookmark_interval, history_limit=args.history,
                        service_cidr=args.service_cidr, service_cidr_v6=args.service_cidr_v6,
                        api_level=args.api_level, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, token=args.token,
                        watch_cache=not args.no_watch_cache)
    except (ManifestError, ApiError, ValueError) as exc:
        print(f"sim: cannot load manifests: {exc}", file=sys.stderr)
        return 1
    url = sim.start()
    if args.kubeconfig_out:
        sim.write_kubeconfig(args.kubeconfig_out)
    print(f"listening on {url}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
