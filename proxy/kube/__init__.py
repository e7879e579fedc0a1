"""The API server's side: configuration and client (kubeconfig.py, client.py), list and
watch (reflector.py: the run loop, with list_pager.py and listsplit.py for lists,
watch_stream.py for watch streams, request_errors.py, backoff.py; cluster_watch.py: every
resource a node watches), raw JSON to model types (decode.py, identity.py), applying them
to the model (ingest.py), the resources watched (resources.py), and reading manifests
from files (manifests.py)."""
