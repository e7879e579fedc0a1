"""The real-control-plane lab: kube-apiserver, kube-controller-manager, kube-proxy and
kubeadm v1.20.2 built from Debian's source (`build`), run in a lab namespace
(`controlplane`), with raw API access (`rawapi`), object builders (`clusters`) and node-side
proxies and pods (`nodes`). tests/realcp and bench.realcp_latency/bench.reflector_fleet use
it."""
