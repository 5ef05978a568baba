"""The request envelope ``{metadata, rawdata}`` (contract §2.1): its models, reading it from a
request (``read_envelope``), validating a part of it (``validate_as``: 400 ``VALIDATION``
naming the fields), and the request id every later error echoes (``remember_request_id``)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_runtime.api.ids import Id, is_id, printable
from agent_runtime.api.json_body import parse_body
from agent_runtime.errors import ValidationFailed


class Extra(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_id: Id | None = None


class Metadata(BaseModel):
    """Envelope metadata; which ids are required is each endpoint's business."""

    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: Id | None = None
    session_id: Id | None = None
    bot_id: Id | None = None
    extra: Extra = Field(default_factory=Extra)


class AdminMetadata(Metadata):
    request_id: Id


class Envelope(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: Metadata
    rawdata: dict[str, Any] = Field(default_factory=dict)


class AdminEnvelope(Envelope):
    metadata: AdminMetadata


M = TypeVar("M", bound=BaseModel)


def error_text(err: Any) -> str:
    """One pydantic error's message, as the failure envelope shows it."""
    if err.get("type") == "extra_forbidden":
        return "unknown field"
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")


def describe_validation_error(exc: ValidationError, *, prefix: str | None) -> str:
    """One readable part per problem, naming the field: ``item.sse_port: Input should be ...``.
    A field name comes from the caller: it is shown escaped and cut (``printable``)."""
    parts = []
    for err in exc.errors(include_url=False):
        path = (*([prefix] if prefix else []), *err["loc"])
        loc = ".".join(printable(str(p)) for p in path) or "body"
        parts.append(f"{loc}: {error_text(err)}")
    return "; ".join(parts)


def validate_as(model: type[M], data: Any, *, prefix: str | None) -> M:
    """``model.model_validate(data)``, failing with 400 ``VALIDATION`` naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed(describe_validation_error(exc, prefix=prefix)) from None


def parse_rawdata(model: type[M], rawdata: Any) -> M:
    return validate_as(model, rawdata, prefix="rawdata")


def echoable_request_id(body: Any) -> str | None:
    """``metadata.request_id`` of a parsed body if it is a valid id, else None: an invalid id
    (control or format characters, a lone surrogate, over 256 characters) is never echoed."""
    metadata = body.get("metadata") if isinstance(body, dict) else None
    rid = metadata.get("request_id") if isinstance(metadata, dict) else None
    return rid if is_id(rid) else None


async def read_envelope(request: Request, model: type[M]) -> M:
    """The request body as ``model``, whatever the Content-Type; anything else is 400
    ``VALIDATION``. Called after the token check (so a caller without a token learns nothing
    about the body rules); remembers the request_id as soon as it parses, so every later
    error echoes it."""
    data = parse_body(await request.body())
    remember_request_id(request, echoable_request_id(data))
    return validate_as(model, data, prefix=None)


def remember_request_id(request: Request, request_id: str | None) -> None:
    """Handlers call this first, so an error raised later still echoes the id."""
    request.state.request_id = request_id


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)
