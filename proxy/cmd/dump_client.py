"""`python -m proxy dump [ADDRESS]`: ask a running agent what it does: its /debug/dump,
as a table on a terminal or JSON (`-o json`, the document the agent serves, unchanged).

ADDRESS is the agent's --metrics-bind-address or a URL; by default 127.0.0.1:10249, then
[::1]:10249 if nothing listens there (where an IPv6 cluster's agent listens: kube-proxy's
bindAddress "::"). The agent answers the dump to clients on a loopback address only,
unless it runs with --debug-dump=true: ask from its node, or `kubectl port-forward` to
its pod first, which connects from the node's loopback.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from proxy.cmd.explain import add_output, write

DEFAULT_ADDRESSES = ("127.0.0.1:10249", "[::1]:10249")  # tried in turn
TIMEOUT = 10.0


def build_parser(prog: str = "python -m proxy dump") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", nargs="?", metavar="ADDRESS",
                   help="HOST:PORT of the agent's metrics server, or a URL (default "
                        f"{DEFAULT_ADDRESSES[0]}, then {DEFAULT_ADDRESSES[1]})")
    p.add_argument("--service", metavar="NAMESPACE/NAME", help="only show this service")
    add_output(p)
    return p


def dump_url(address: str, service: str | None) -> str:
    base = address if "://" in address else f"http://{address}"
    parts = urllib.parse.urlsplit(base)
    path = parts.path.rstrip("/")
    if not path.endswith("/debug/dump"):
        path += "/debug/dump"
    query = urllib.parse.urlencode({"service": service}) if service else parts.query
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, query, ""))


class NothingListens(RuntimeError):
    """The connection was refused: no agent listens at that address."""


def fetch(url: str) -> dict[str, Any]:
    """The dump, or a RuntimeError saying, for a person, why not."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace").strip()
        raise RuntimeError(f"{url}: HTTP {exc.code}: {body[:300]}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        kind = NothingListens if isinstance(reason, ConnectionRefusedError) else RuntimeError
        raise kind(f"{url}: {reason} (is the agent running, and is this its "
                   "--metrics-bind-address?)") from None
    except ValueError:
        raise RuntimeError(f"{url}: the answer is not JSON (not a sliceproxy agent?)") from None
    if not isinstance(doc, dict) or "services" not in doc:
        raise RuntimeError(f"{url}: not a sliceproxy /debug/dump")
    return doc


def main(argv: list[str], prog: str | None = None) -> int:
    args = build_parser(prog or "python -m proxy dump").parse_args(argv)
    addresses = [args.address] if args.address else list(DEFAULT_ADDRESSES)
    if urllib.parse.urlsplit(addresses[0] if "://" in addresses[0]
                             else f"http://{addresses[0]}").scheme not in ("http", "https"):
        print(f"dump: {args.address!r} is not HOST:PORT or an http(s) URL", file=sys.stderr)
        return 2
    for address in addresses:
        try:
            doc = fetch(dump_url(address, args.service))
            break
        except NothingListens as exc:
            if address != addresses[-1]:
                continue
            print(f"dump: {exc}", file=sys.stderr)
            return 1
        except RuntimeError as exc:
            print(f"dump: {exc}", file=sys.stderr)
            return 1
    write(doc, args.output)
    return 0
