"""Lab harnesses that the tests and the benchmarks share (never shipped: the image holds
proxy/ only). `labs.realcp` is a real Kubernetes v1.20.2 control plane built from Debian's
source, `labs.kernel` Debian's own kernel booted under QEMU (the host has no IPVS), and
`labs.debian` the package cache both fill. The network-namespace lab itself is
`proxy.netns_lab` (the demo uses it too). Nothing here imports `tests` or `bench`."""
