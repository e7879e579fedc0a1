"""The API server's side: configuration and client (kubeconfig.py, client.py), list and
watch (reflector.py, watch.py, listsplit.py), raw JSON to model types (decode.py,
identity.py), applying them to the model (ingest.py), the resources watched
(resources.py), and reading manifests from files (manifests.py)."""
