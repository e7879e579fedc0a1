"""Harness self-test: report what the harness promises a guest script.

``probe.py [ARGS...]`` writes a JSON report (IPVS reachable through pyroute2, lo up,
sysctls, argv, a writable scratch folder); ``probe.py fail`` exits 3 after writing to
stderr; ``probe.py hang`` never returns (for the timeout path).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from labs.kernel.guest import write_result

IFF_UP = 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["fail"]:
        print("probe: failing on purpose", file=sys.stderr)
        return 3
    if argv[:1] == ["hang"]:
        print("probe: hanging on purpose", flush=True)
        threading.Event().wait()  # never set: only the harness's timeout ends this
    # Imported here: pyroute2 takes seconds to import in the guest; keep fail/hang quick.
    from pyroute2 import IPVS, IPRoute

    with IPRoute() as ipr:
        links = {str(link.get("ifname")): int(link["flags"]) for link in ipr.get_links()}
    with IPVS() as ipvs:
        services = len(ipvs.service("dump"))
    scratch = Path(os.environ["KERNEL_SCRATCH"]) / "probe"
    scratch.write_text("ok")
    write_result(
        {
            "argv": argv,
            "kernel": os.uname().release,
            "links": sorted(links),
            "lo_up": bool(links.get("lo", 0) & IFF_UP),
            "ipvs_services": services,
            "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
            "vs_conntrack": Path("/proc/sys/net/ipv4/vs/conntrack").read_text().strip(),
            "scratch_ok": scratch.read_text() == "ok",
        }
    )
    print("probe done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
