"""The API's answers at its edges, in both apps that serve it: the API's own (create_app, served
from a thread here) and the web app (app.py: the same routes beside the Gradio page mounted at
/). A method a path does not take is a 405 with Allow, a /v1 path the API does not have a 404,
both in the API's error shape (OpenAI's error object), never Gradio's or FastAPI's
{"detail": ...}."""

import http.client
import json
from urllib.parse import urlsplit

import pytest
from test_api import local_api  # noqa: F401 -- the fixture: the API's own app, in a thread

APPS = ("api", "web")


@pytest.fixture(params=APPS)
def address(request) -> tuple[str, int]:
    """(host, port) of the API's own app, then of the web app (the suite's app_server)."""
    if request.param == "api":
        return "127.0.0.1", request.getfixturevalue("local_api")
    url = urlsplit(request.getfixturevalue("app_server").url)
    return url.hostname, url.port


def raw(address, method: str, path: str, body: dict | None = None):
    """(status, headers, body) of one request, as the server wrote them."""
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def api_error(headers, body: bytes) -> dict:
    """The error object of an answer in the API's error shape (anything else fails)."""
    assert headers.get("content-type", "").startswith("application/json"), headers
    reply = json.loads(body)
    assert set(reply) == {"error"}, reply  # not {"detail": ...}
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("PUT", "/v1/chat/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PATCH", "/v1/models/default", "GET"),
        ("PUT", "/tokenize", "POST"),
    ],
)
def test_a_method_a_path_does_not_take_is_a_405_with_allow(address, method, path, allow):
    status, headers, body = raw(address, method, path, {"messages": []})
    assert (status, headers.get("Allow")) == (405, allow), (method, path, body)
    error = api_error(headers, body)
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert f"takes {allow}" in error["message"], error


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/nothing"),
        ("POST", "/v1/chat/completion"),  # a typo of a route
        ("PUT", "/v1/embeddings"),  # a wrong method on a path that is not there either
        ("DELETE", "/v1/a/b/c"),
        ("GET", "/v1"),
        ("GET", "/v1/"),
    ],
)
def test_an_unknown_v1_path_is_a_404_in_the_api_error_shape(address, method, path):
    status, headers, body = raw(address, method, path, {"prompt": "hi"})
    assert status == 404, (method, path, body)
    assert api_error(headers, body) == {
        "message": "Not Found",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_the_web_app_still_serves_its_page_beside_the_api(app_server):
    address = (urlsplit(app_server.url).hostname, urlsplit(app_server.url).port)
    status, headers, body = raw(address, "GET", "/")
    assert status == 200 and headers.get("content-type", "").startswith("text/html")
    assert b"MiniServeLM" in body
    status, headers, body = raw(address, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["object"] == "list"
