"""Typed errors to HTTP statuses and OpenAI error bodies, checked against the official client."""
from __future__ import annotations

from typing import Any

import openai
import pytest

from tandem import errors
from tandem.frontend.errors import HTTP_ERRORS, INTERNAL_MESSAGE, error_body, http_error

httpx = pytest.importorskip("httpx2")  # the transport the installed openai client is built on

EXPECTED = [
    (errors.InvalidRequest, 400, "invalid_request_error", None),
    (errors.ModelNotFound, 404, "not_found_error", "model_not_found"),
    (errors.NotFound, 404, "invalid_request_error", "not_found"),
    (errors.Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (errors.Overloaded, 429, "rate_limit_error", None),
    (errors.Unavailable, 503, "service_unavailable", None),
    (errors.DeadlineExceeded, 504, "timeout", None),
    (errors.Cancelled, 499, "cancelled", None),
    (errors.FailedPrecondition, 400, "invalid_request_error", "failed_precondition"),
    (errors.Unimplemented, 501, "not_implemented", None),
    (errors.UpstreamError, 502, "upstream_error", None),
]


def test_error_body_shape() -> None:
    assert error_body("bad", "invalid_request_error") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert error_body("m", "t", "p", "c")["error"] == {
        "message": "m", "type": "t", "param": "p", "code": "c"}


def test_table_covers_every_typed_error() -> None:
    concrete = set(errors.TandemError.__subclasses__())
    assert set(HTTP_ERRORS) == concrete == {row[0] for row in EXPECTED}


@pytest.mark.parametrize(("cls", "status", "kind", "code"), EXPECTED)
def test_typed_errors_keep_message_and_param(
    cls: type[errors.TandemError], status: int, kind: str, code: str | None
) -> None:
    assert http_error(cls("what went wrong", param="field")) == (status, {
        "error": {"message": "what went wrong", "type": kind, "param": "field", "code": code}})


def test_subclass_maps_through_its_base() -> None:
    class QueueFull(errors.Overloaded):
        pass

    status, body = http_error(QueueFull("queue full"))
    assert status == 429 and body["error"]["message"] == "queue full"


@pytest.mark.parametrize("exc", [
    RuntimeError("secret path /etc/passwd"),
    KeyError("token_ids"),
    errors.TandemError("bare base class, no row"),
])
def test_anything_else_is_a_generic_500(exc: BaseException) -> None:
    status, body = http_error(exc)
    assert status == 500
    assert body == {"error": {"message": INTERNAL_MESSAGE, "type": "internal_error",
                              "param": None, "code": None}}


@pytest.mark.parametrize(("exc", "sdk_error"), [
    (errors.InvalidRequest("'max_tokens' must be >= 1, got 0", param="max_tokens"),
     openai.BadRequestError),
    (errors.ModelNotFound("model 'x' is not served"), openai.NotFoundError),
    (errors.Overloaded("queue full"), openai.RateLimitError),
    (errors.Unavailable("draining"), openai.InternalServerError),
    (RuntimeError("boom"), openai.InternalServerError),
])
def test_official_client_reads_the_error(exc: BaseException, sdk_error: type) -> None:
    status, body = http_error(exc)

    def handler(request: Any) -> Any:
        return httpx.Response(status, json=body)

    client = openai.OpenAI(api_key="k", base_url="http://tandem.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with pytest.raises(sdk_error) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == status
    assert info.value.type == body["error"]["type"]
    assert info.value.param == body["error"]["param"]
    assert info.value.code == body["error"]["code"]
    assert body["error"]["message"] in info.value.message
