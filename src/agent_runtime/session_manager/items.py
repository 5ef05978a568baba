"""Configuration items (contract §3): templates and routing rules, the domain of config_sync.

Items are validated strictly: unknown fields are refused, bools are not ints, numbers are in
range, names are what Kubernetes accepts. A bad item is refused before anything is locked or
written, with a message that names the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    create_model,
    model_validator,
)

from agent_runtime import spec_fields
from agent_runtime.api.ids import PRINTABLE_CLASS, PRINTABLE_PATTERN, Id, no_control
from agent_runtime.api.request import validate_as
from agent_runtime.util import max_pods

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|Ki|Mi|Gi|Ti|Pi|Ei)?$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# The pod name is "{pod_name}-{10}-{5}" and is also the `app` label value (max 63).
POD_NAME_MAX = 63 - 17
MAX_CONCURRENCY = 100_000
MAX_TTL = 30 * 24 * 3600
MAX_POD_BUDGET = 1_000_000
WILDCARD = "*"


def _dns_label(value: str) -> str:
    if not _DNS1123_LABEL.fullmatch(value):
        raise ValueError("must be a DNS-1123 label (lowercase alphanumerics and '-')")
    return value


def _quantity(value: str) -> str:
    if not _QUANTITY.fullmatch(value):
        raise ValueError("must be a Kubernetes quantity such as 500m, 1, 256Mi or 1Gi")
    return value


def _abs_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must be an absolute path starting with '/'")
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (a process environment cannot hold it)")
    return value


no_control_ = AfterValidator(no_control)


def _env(value: dict[str, Any]) -> dict[str, Any]:
    for name in value:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"env name {name!r} is not a valid environment variable name")
    return value


def _documented(pattern: str) -> dict[str, Any]:
    """A pattern for the OpenAPI schema only (the validators below are what the server runs)."""
    return {"json_schema_extra": {"pattern": pattern}}


Text = Annotated[
    str, Field(min_length=1, max_length=1024, **_documented(PRINTABLE_PATTERN)), no_control_
]
EnvName = Annotated[
    str, Field(min_length=1, max_length=1024, **_documented(_ENV_NAME.pattern)), no_control_
]
DnsLabel = Annotated[
    str,
    Field(min_length=1, max_length=63, **_documented(_DNS1123_LABEL.pattern)),
    AfterValidator(_dns_label),
]
Quantity = Annotated[
    str,
    Field(min_length=1, max_length=32, **_documented(_QUANTITY.pattern)),
    AfterValidator(_quantity),
]
Port = Annotated[int, Field(ge=1, le=65535)]
Concurrency = Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)]
Ttl = Annotated[int, Field(ge=1, le=MAX_TTL)]
_ABS_PATH_PATTERN = f"^/{PRINTABLE_CLASS}*$"
AbsPath = Annotated[
    str,
    Field(min_length=1, max_length=1024, **_documented(_ABS_PATH_PATTERN)),
    no_control_,
    AfterValidator(_abs_path),
]
EnvValue = Annotated[str, Field(max_length=32768), AfterValidator(_no_nul)]
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
MAX_ENV = 256  # variables per template
_DNS_SUBDOMAIN_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)  # Secret names
_SECRET_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")


def _dns_subdomain(value: str) -> str:
    if not _DNS_SUBDOMAIN_RE.fullmatch(value):
        raise ValueError("must be a DNS-1123 subdomain (lowercase alphanumerics, '-' and '.')")
    return value


def _secret_key(value: str) -> str:
    if not _SECRET_KEY_RE.fullmatch(value):
        raise ValueError("must consist of alphanumerics, '-', '_' or '.'")
    return value


class SecretKeyRef(BaseModel):
    """One key of a Kubernetes Secret in the pod's namespace: the pod reads it, the service
    never sees its value."""

    model_config = _STRICT
    name: Annotated[
        str,
        Field(min_length=1, max_length=253, **_documented(_DNS_SUBDOMAIN_RE.pattern)),
        AfterValidator(_dns_subdomain),
    ]
    key: Annotated[
        str,
        Field(min_length=1, max_length=253, **_documented(_SECRET_KEY_RE.pattern)),
        AfterValidator(_secret_key),
    ]
    optional: bool = False


class EnvSource(BaseModel):
    model_config = _STRICT
    secretKeyRef: SecretKeyRef  # Kubernetes spells it so


class EnvFrom(BaseModel):
    """``{"valueFrom": {"secretKeyRef": {"name", "key", "optional"?}}}``: an env value taken
    from a Secret when the pod starts (rendered as the container's ``valueFrom``)."""

    model_config = _STRICT
    valueFrom: EnvSource


_ENV_VALUE = TypeAdapter(EnvValue)
_ENV_FROM = TypeAdapter(EnvFrom)


def _env_entry(value: Any) -> str | EnvFrom:
    """A string, or a ``valueFrom`` object: checked as the one its shape says, so a bad value
    gets that one's message (a union would report both)."""
    adapter: TypeAdapter[Any] = _ENV_FROM if isinstance(value, dict) else _ENV_VALUE
    try:
        return cast(str | EnvFrom, adapter.validate_python(value, strict=True))
    except ValidationError as exc:
        parts = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"])
            message = str(err["msg"]).removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if where else message)
        raise ValueError("; ".join(parts)) from None


EnvEntry = Annotated[
    Any,
    AfterValidator(_env_entry),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "maxLength": 32768},
                {
                    "type": "object",
                    "required": ["valueFrom"],
                    "additionalProperties": False,
                    "description": '{"valueFrom": {"secretKeyRef": {"name": <Secret, '
                    'DNS-1123 subdomain>, "key": <[-._a-zA-Z0-9]+>, "optional": <bool>}}}',
                },
            ]
        }
    ),
]


class TemplateItem(BaseModel):
    """One template, complete (defaults filled). Field names are the contract's."""

    model_config = _STRICT

    template_id: Id
    enabled: bool = True
    # deploy fields
    image: Text
    pod_name: Annotated[
        str,
        Field(max_length=POD_NAME_MAX, **_documented(_DNS1123_LABEL.pattern)),
        AfterValidator(_dns_label),
    ] = "agent"
    namespace: DnsLabel | None = None
    container_port: Port = 8080
    sse_port: Port = 8080
    sse_path: Annotated[
        str,
        Field(max_length=256, **_documented(_ABS_PATH_PATTERN)),
        no_control_,
        AfterValidator(_abs_path),
    ] = "/sse"
    cpu_request: Quantity | None = None
    cpu_limit: Quantity | None = None
    memory_request: Quantity | None = None
    memory_limit: Quantity | None = None
    env: Annotated[dict[EnvName, EnvEntry], Field(max_length=MAX_ENV), AfterValidator(_env)] = (
        Field(default_factory=dict)
    )
    nfs_server: Text | None = None
    nfs_path: AbsPath | None = None
    nfs_mount_path: AbsPath | None = None
    ready_timeout: Annotated[float, Field(gt=0, le=3600)] = 300.0
    ready_poll_interval: Annotated[float, Field(gt=0, le=60)] = 2.0
    kubeconfig: Text | None = None
    # policy fields
    scope_concurrency: Concurrency = 10
    pod_concurrency: Concurrency = 5
    session_ttl: Ttl = 60
    pod_ttl: Ttl = 300
    min_idle_pods: Annotated[int, Field(ge=0, le=MAX_CONCURRENCY)] = 0
    # how the warm pool is sized: the min_idle_pods floor, or from the measured demand
    warm_pool: Literal["static", "predictive"] = "static"

    @model_validator(mode="after")
    def _consistent(self) -> TemplateItem:
        nfs = (self.nfs_server, self.nfs_path, self.nfs_mount_path)
        if any(v is not None for v in nfs) and not all(v is not None for v in nfs):
            raise ValueError("nfs_server, nfs_path and nfs_mount_path go together: set all or none")
        if self.ready_poll_interval > self.ready_timeout:
            raise ValueError("ready_poll_interval must not exceed ready_timeout")
        if self.min_idle_pods > self.max_pods:
            raise ValueError(
                f"min_idle_pods ({self.min_idle_pods}) exceeds max_pods ({self.max_pods} = "
                "ceil(scope_concurrency / pod_concurrency))"
            )
        return self

    @property
    def max_pods(self) -> int:
        return max_pods(self.scope_concurrency, self.pod_concurrency)

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def deploy_ver(self) -> str:
        return spec_fields.deploy_ver(self.as_dict())

    def pod_spec(self) -> dict[str, Any]:
        return spec_fields.deploy_subset(self.as_dict())


class RoutingRuleItem(BaseModel):
    """``(group_id, bot_id) → template_id``; ``*`` is a wildcard on either side.

    ``pod_budget``: how many pods (deploys in flight included) the scopes this rule resolves
    may have together; null = the default (``AGENT_RUNTIME_WILDCARD_RULE_POD_BUDGET`` for a
    rule with a ``*``, unbounded for an exact one: its scope's max_pods bounds it)."""

    model_config = _STRICT

    group_id: Id
    bot_id: Id
    template_id: Id
    pod_budget: Annotated[int, Field(ge=1, le=MAX_POD_BUDGET)] | None = None

    @property
    def wildcard(self) -> bool:
        return WILDCARD in (self.group_id, self.bot_id)

    def effective_pod_budget(self, wildcard_default: int) -> int:
        """The budget that applies (0 = unbounded)."""
        if self.pod_budget is not None:
            return self.pod_budget
        return wildcard_default if self.wildcard else 0


class TemplateKey(BaseModel):
    model_config = _STRICT
    template_id: Id


class RoutingRuleKey(BaseModel):
    model_config = _STRICT
    group_id: Id
    bot_id: Id


M = TypeVar("M", bound=BaseModel)


def parse_item(model: type[M], data: dict[str, Any]) -> M:
    """Validate a config_sync ``item``; a failure names each bad field (``item.<field>``)."""
    return validate_as(model, data, prefix="item")


def partial_model(
    model: type[BaseModel], name: str, *, ids: tuple[str, ...], others_ignored: bool
) -> type[BaseModel]:
    """``model``'s fields with only ``ids`` required: a partial update (the others optional,
    each checked on its own; the whole item is checked after merging), or a delete (the others
    accepted and ignored, any value). No model validator is carried over."""
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        annotated = (
            Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        )
        if field_name in ids:
            fields[field_name] = (annotated, ...)
        else:
            fields[field_name] = (Any if others_ignored else annotated, None)
    return create_model(name, __config__=_STRICT, **fields)


TemplatePatch = partial_model(
    TemplateItem, "TemplatePatch", ids=("template_id",), others_ignored=False
)
