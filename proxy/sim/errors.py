"""API errors as the real API server reports them: a `Status` object with a reason and code.

Messages follow apimachinery's `k8s.io/apimachinery/pkg/api/errors` wording, because
clients (kubectl, client libraries, our agent) match on reason and code and people read
the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.sim.resources import ResourceType


@dataclass(frozen=True, slots=True)
class Cause:
    """One field error of an Invalid status (`details.causes[]`)."""

    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    message: str  # e.g. 'Invalid value: 70000: must be between 1 and 65535, inclusive'
    field: str  # e.g. 'spec.ports[0].port'

    def text(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def as_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}


@dataclass(slots=True)
class ApiError(Exception):
    """An error the server answers with a `Status` body."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None
    # Extra list metadata (the "inconsistent continue" token of an expired page).
    continue_token: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.continue_token is not None:
            meta["continue"] = self.continue_token
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": meta,
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.plural  # upstream puts the resource here, not the kind
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', _details(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        _details(rt, name),
    )


OBJECT_MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def invalid(rt: ResourceType, name: str, causes: list[Cause]) -> ApiError:
    texts = [c.text() for c in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details: dict[str, Any] = {"name": name}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.kind
    details["causes"] = [c.as_dict() for c in causes]
    return ApiError(422, "Invalid", f'{rt.group_kind} "{name}" is invalid: {joined}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed",
                    "the server does not allow this method on the requested resource", {})


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
        f"accepted media types include: application/json-patch+json, "
        f"application/merge-patch+json, application/strategic-merge-patch+json "
        f"(got {content_type!r})"
    )


def expired(message: str, continue_token: str | None = None) -> ApiError:
    return ApiError(410, "Expired", message, continue_token=continue_token)


def too_large_resource_version(requested: int, current: int) -> ApiError:
    return ApiError(
        504,
        "Timeout",
        # The watch cache's "Too large resource version" wrapped in the handler's
        # timeout error, whose text upstream prefixes with "Timeout: ".
        f"Timeout: Too large resource version: {requested}, current: {current}",
        {
            "causes": [
                {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
            ],
            "retryAfterSeconds": 1,
        },
    )


def namespace_not_found(name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'namespaces "{name}" not found', {"name": name, "kind": "namespaces"}
    )


def namespace_terminating(rt: ResourceType, name: str, namespace: str) -> ApiError:
    return ApiError(
        403,
        "Forbidden",
        f'{rt.qualified} "{name}" is forbidden: unable to create new content in namespace '
        f"{namespace} because it is being terminated",
        {
            "name": name,
            **({"group": rt.group} if rt.group else {}),
            "kind": rt.plural,
            "causes": [
                {
                    "reason": "NamespaceTerminating",
                    "message": f"namespace {namespace} is being terminated",
                    "field": "metadata.namespace",
                }
            ],
        },
    )


def injected(code: int, retry_after: int | None) -> ApiError:
    """A fault-injected failure, shaped like what the real server sends for that code."""
    if code == 429:
        return ApiError(
            429,
            "TooManyRequests",
            "Too many requests, please try again later.",
            {"retryAfterSeconds": retry_after or 1},
            headers={"Retry-After": str(retry_after or 1)},
        )
    if code == 503:
        return ApiError(503, "ServiceUnavailable", "the server is currently unable to handle "
                        "the request (injected fault)",
                        headers={"Retry-After": str(retry_after)} if retry_after else {})
    return ApiError(code, "InternalError", "Internal error occurred: injected fault",
                    {"causes": [{"message": "injected fault"}]})
