"""The client's error table is the service's: one exception class per error code of
``agent_runtime.errors`` (the API reference's table), with the same HTTP status. A code added
to the service without its class in ``client/`` fails here."""

from __future__ import annotations

from agent_runtime import errors as service_errors
from agent_runtime_client import ERROR_CLASSES, AgentRuntimeError


def service_statuses() -> dict[str, int]:
    found: dict[str, int] = {}
    pending = list(service_errors.AgentRuntimeError.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        found[cls.code.value] = cls.http_status
    return found


def test_one_client_class_per_service_code() -> None:
    assert set(ERROR_CLASSES) == {code.value for code in service_errors.ErrorCode}


def test_each_class_has_the_services_status() -> None:
    statuses = service_statuses()
    assert set(statuses) == set(ERROR_CLASSES)
    for code, cls in ERROR_CLASSES.items():
        assert issubclass(cls, AgentRuntimeError)
        assert (code, statuses[code]) == (cls.CODE, cls.HTTP_STATUS), code


def test_the_classes_are_distinct() -> None:
    assert len(set(ERROR_CLASSES.values())) == len(ERROR_CLASSES)
