"""The answer envelopes (contract §2.2): ``ok`` and ``failure``. A failure carries its code in
the body and in ``X-Error-Code`` (metrics and gateways read it there), ``retry_after`` and
``Retry-After`` where the code has one; its message is cut and escaped (``printable``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from agent_runtime.api.ids import is_id, printable
from agent_runtime.errors import ErrorCode

MAX_MESSAGE = 4096  # characters of an error_message; a longer one is cut


def ok(request_id: str | None, data: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"ok": True, "request_id": request_id, "data": data})


ERROR_CODE_HEADER = "X-Error-Code"


def failure(
    status: int,
    code: ErrorCode,
    message: str,
    request_id: str | None,
    retry_after: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "ok": False,
        "request_id": request_id if request_id is None or is_id(request_id) else None,
        "error_code": code.value,
        "error_message": printable(message, limit=MAX_MESSAGE),
    }
    # the code as a header too: metrics (and a gateway) read it without parsing the body
    out = {**(headers or {}), ERROR_CODE_HEADER: code.value}
    if retry_after is not None:
        seconds = max(1, math.ceil(retry_after))  # the header takes whole seconds
        body["retry_after"] = seconds
        out["Retry-After"] = str(seconds)
    return JSONResponse(body, status_code=status, headers=out)
