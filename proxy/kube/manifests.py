"""Reading Kubernetes manifests: YAML or JSON, single objects, multi-document, `kind: List`.

Shared by `python -m proxy explain`, the simulator's `-f` and the demo. Errors are
`ManifestError` with the file name and what was wrong, never a bare parser traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

try:  # the C loader is ~10x faster on big `kubectl get -o yaml` dumps
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


class ManifestError(Exception):
    """A manifest could not be read or parsed."""


def parse_documents(text: str, source: str = "<input>") -> list[dict[str, Any]]:
    """Parse YAML or JSON text into a flat list of objects (Lists expanded).

    Empty documents are dropped; anything that is not a mapping is an error.
    """
    stripped = text.lstrip()
    try:
        if stripped.startswith(("{", "[")):
            docs: list[Any] = [json.loads(text)]
        else:
            docs = list(yaml.load_all(text, Loader=_Loader))
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{source}: not valid YAML or JSON: {exc}") from exc
    out: list[dict[str, Any]] = []
    for index, doc in enumerate(docs):
        out.extend(_flatten(doc, f"{source} (document {index + 1})"))
    return out


def _flatten(doc: Any, where: str) -> Iterator[dict[str, Any]]:
    if doc is None:
        return
    if isinstance(doc, list):  # a bare JSON array of objects
        for item in doc:
            yield from _flatten(item, where)
        return
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected an object, got {type(doc).__name__}")
    kind = doc.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
        # kind: List, or a typed list such as ServiceList from `kubectl get -o json`.
        item_kind = kind[: -len("List")] if kind != "List" else None
        for item in doc["items"]:
            if isinstance(item, dict) and item_kind and "kind" not in item:
                item = {**item, "kind": item_kind, "apiVersion": doc.get("apiVersion")}
            yield from _flatten(item, where)
        return
    yield doc


def manifest_files(path: Path) -> list[Path]:
    """A file, or every manifest file under a directory (sorted, recursive)."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in MANIFEST_SUFFIXES and p.is_file())
    if not path.exists():
        raise ManifestError(f"{path}: no such file or directory")
    return [path]


def load_paths(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Load every object from the given files or directories, in order."""
    out: list[dict[str, Any]] = []
    for raw in paths:
        for file in manifest_files(Path(raw)):
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ManifestError(f"{file}: cannot read: {exc}") from exc
            out.extend(parse_documents(text, str(file)))
    return out
