"""The embedded cluster simulator: a Kubernetes API server subset (core/v1 services,
endpoints, nodes, namespaces; discovery.k8s.io/v1 and v1beta1 endpointslices) for the demo
and tests.

`python -m proxy.sim` serves it; `SimServer` runs it in-process on a background thread.
"""

from proxy.sim.harness import SimServer, kubeconfig
from proxy.sim.store import Store

__all__ = ["SimServer", "Store", "kubeconfig"]
