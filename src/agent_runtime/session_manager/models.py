"""The session manager's HTTP models: request envelopes (route, touch, config_sync, cleanup)
and answers. The configuration items they carry are ``items.py``; the OpenAPI-only models
below describe config_sync's per-kind bodies, nothing validates with them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from agent_runtime import label_selector
from agent_runtime.api.ids import Id
from agent_runtime.api.request import AdminMetadata, validate_as
from agent_runtime.resource_manager.facade import CLEANUP_PREVIEW_MAX
from agent_runtime.session_manager.items import (
    DnsLabel,
    RoutingRuleItem,
    TemplateItem,
    TemplatePatch,
    no_control_,
    partial_model,
)
from agent_runtime.util import scope_id_of

SessionId = Id  # any id: no session key can be another key (state.py keeps them apart)


def _label_selector(value: str) -> str:
    label_selector.parse(value)  # ValueError naming the requirement (the one parser we have)
    return value


class RouteExtra(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_id: Id


class RouteMetadata(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: Id
    session_id: SessionId
    bot_id: Id
    extra: RouteExtra


class RouteRawdata(BaseModel):
    """route's ``rawdata``: optional; other fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    # the pod whose stream the gateway just saw fail (checked at once; see api.md)
    failed_pod_id: Id | None = None


class RouteEnvelope(BaseModel):
    """route: every id required (contract §2.3)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: RouteMetadata
    rawdata: RouteRawdata = Field(default_factory=RouteRawdata)


class TouchExtra(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_id: Id | None = None


class TouchMetadata(BaseModel):
    """touch: ``bot_id`` and ``extra.group_id`` are optional, but go together: with them the
    session is looked for in that scope only (on a Redis Cluster, one call on its node)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: Id | None = None
    session_id: SessionId
    bot_id: Id | None = None
    extra: TouchExtra = Field(default_factory=TouchExtra)

    @model_validator(mode="after")
    def _scope_ids_together(self) -> TouchMetadata:
        if (self.bot_id is None) != (self.extra.group_id is None):
            missing = "extra.group_id" if self.extra.group_id is None else "bot_id"
            raise ValueError(f"{missing}: required with the other scope id")
        return self

    def scope_id(self) -> str | None:
        """The scope both ids name, or None when the gateway sent neither."""
        if self.bot_id is None or self.extra.group_id is None:
            return None
        return scope_id_of(self.extra.group_id, self.bot_id)


class TouchRawdata(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    eos: bool = False


class TouchEnvelope(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: TouchMetadata
    rawdata: TouchRawdata = Field(default_factory=TouchRawdata)


class CleanupRequest(BaseModel):
    """``rawdata`` of cleanup: all optional (default namespace; the component label; a real
    cleanup)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    namespace: DnsLabel | None = None
    label_selector: (
        Annotated[
            str,
            Field(min_length=1, max_length=1024),
            no_control_,
            AfterValidator(_label_selector),
        ]
        | None
    ) = None
    dry_run: bool = Field(
        default=False,
        description="list what the same call would delete, delete nothing (answer: matched, "
        "pods, truncated)",
    )


# a field name of a config_sync item (the longest real one is 19 characters)
ItemField = Annotated[str, Field(min_length=1, max_length=64), no_control_]
Kind = Literal["template", "routing_rule"]
Op = Literal["create", "update", "delete", "sync"]


class ConfigSyncRequest(BaseModel):
    """``rawdata`` of config_sync."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Kind
    op: Op
    item: dict[ItemField, Any]


def check_fields(request: ConfigSyncRequest) -> None:
    """400 for a bad field of a partial template update before anything is looked up: without
    this, an update of a missing template with a bad field was a 404, an existing one a 400."""
    if request.kind == "template" and request.op == "update":
        validate_as(TemplatePatch, request.item, prefix="item")


# --- OpenAPI documentation only ------------------------------------------------------------------
# The handlers read bodies by hand (after the token check) and config_sync validates its item
# per kind and op; these models only describe that in the schema. Nothing validates with them.


TemplateKeyItem = partial_model(
    TemplateItem, "TemplateKeyItem", ids=("template_id",), others_ignored=True
)
RoutingRuleKeyItem = partial_model(
    RoutingRuleItem, "RoutingRuleKeyItem", ids=("group_id", "bot_id"), others_ignored=True
)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TemplateWrite(_Doc):
    kind: Literal["template"]
    op: Literal["create", "sync"]
    item: TemplateItem


class TemplateUpdate(_Doc):
    """update: the id and the fields to change."""

    kind: Literal["template"]
    op: Literal["update"]
    item: TemplatePatch  # type: ignore[valid-type]


class TemplateDelete(_Doc):
    """delete: the id (other known fields are ignored)."""

    kind: Literal["template"]
    op: Literal["delete"]
    item: TemplateKeyItem  # type: ignore[valid-type]


class RoutingRuleWrite(_Doc):
    kind: Literal["routing_rule"]
    op: Literal["create", "sync", "update"]
    item: RoutingRuleItem


class RoutingRuleDelete(_Doc):
    kind: Literal["routing_rule"]
    op: Literal["delete"]
    item: RoutingRuleKeyItem  # type: ignore[valid-type]


class ConfigSyncEnvelope(BaseModel):
    """config_sync request: ``metadata.request_id`` required; ``rawdata`` per kind and op."""

    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: AdminMetadata
    rawdata: TemplateWrite | TemplateUpdate | TemplateDelete | RoutingRuleWrite | RoutingRuleDelete


class CleanupEnvelope(BaseModel):
    """cleanup request: ``metadata.request_id`` required; ``rawdata`` optional."""

    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: AdminMetadata
    rawdata: CleanupRequest = Field(default_factory=CleanupRequest)


class RouteData(BaseModel):
    pod_id: str
    pod_sse_url: str
    placement: Literal["refresh", "placed", "rebound"]
    previous_pod_id: str | SkipJsonSchema[None] = None  # rebound only


class RouteOk(BaseModel):
    ok: Literal[True]
    request_id: str
    data: RouteData


class TouchData(BaseModel):
    touched: bool
    released: bool | SkipJsonSchema[None] = None  # with eos only


class TouchOk(BaseModel):
    ok: Literal[True]
    request_id: str | None
    data: TouchData


class ConfigSyncData(BaseModel):
    kind: Kind
    op: Op
    id: str
    change_class: Literal["deploy", "policy", "none"]
    affected_scopes: Annotated[int, Field(ge=0)]


class ConfigSyncOk(BaseModel):
    ok: Literal[True]
    request_id: str
    data: ConfigSyncData


class CleanupPod(BaseModel):
    """A pod a cleanup's dry run says the same call would delete (Kubernetes' view)."""

    pod_id: str
    namespace: str
    scope_id: str = Field(description="its scope label")
    deploy_ver: str = Field(description="its deploy-ver label (empty: none)")
    phase: str = Field(description="Pending, Running, Terminating, CrashLoopBackOff, …")
    ready: bool
    node: str = Field(description="the node it runs on (empty: not scheduled yet)")
    created: float | None = Field(description="Unix seconds (creationTimestamp), or null")


class CleanupData(BaseModel):
    cleaned: Annotated[int, Field(ge=0)] = Field(description="pods deleted (0 in a dry run)")
    # the dry run's only: absent from a real cleanup's answer (the contract's {"cleaned": n})
    dry_run: Literal[True] | SkipJsonSchema[None] = Field(
        None, description="present (true) in a dry run's answer only"
    )
    matched: Annotated[int, Field(ge=0)] | SkipJsonSchema[None] = Field(
        None, description="dry run: how many pods the same call would delete"
    )
    truncated: bool | SkipJsonSchema[None] = Field(
        None, description="dry run: more pods matched than pods lists"
    )
    pods: list[CleanupPod] | SkipJsonSchema[None] = Field(
        None, description=f"dry run: the first {CLEANUP_PREVIEW_MAX} of them by name"
    )


class CleanupOk(BaseModel):
    ok: Literal[True]
    request_id: str
    data: CleanupData
