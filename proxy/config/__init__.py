"""The agent's configuration: `options` (kube-proxy's flags, the `--config` file and
validation, giving a `Config`) and `kubeproxy_file` (kube-proxy's own
KubeProxyConfiguration read as those options)."""
