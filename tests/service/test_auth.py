"""With an API key, every request but /health needs it as a Bearer token (401 otherwise); a
WebSocket without it is closed with 1008."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.service.config import ServerConfig

from .conftest import running_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    with running_server(tiny_checkpoint, ServerConfig(api_key=KEY)) as server:
        yield server


@pytest.mark.parametrize(
    "path", ["/v1/models", "/metrics", "/v1/chat/completions", "/v1/videos/describe"]
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY])
def test_requests_without_the_key_get_401(keyed_server, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    method = "GET" if path in ("/v1/models", "/metrics") else "POST"
    response = httpx.request(method, keyed_server.url + path, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and "Bearer" in error["message"]


def test_health_is_open_and_the_key_opens_the_rest(keyed_server):
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    client = openai.OpenAI(api_key=KEY, base_url=f"{keyed_server.url}/v1", max_retries=0)
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
    )
    assert response.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            api_key="wrong", base_url=f"{keyed_server.url}/v1", max_retries=0
        ).models.list()


def _session(server, start: dict, headers: dict | None = None) -> tuple[dict, int | None]:
    """The first reply to `start`, and the close code if the server then closes."""
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, proxy=None, additional_headers=headers) as socket:
        socket.send(json.dumps(start))
        reply = json.loads(socket.recv(timeout=30))
        if reply["type"] == "started":
            return reply, None
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=30)
        return reply, closed.value.rcvd.code


def test_websocket_needs_the_key(keyed_server):
    reply, code = _session(keyed_server, {"type": "start"})
    assert (reply["code"], code) == ("invalid_api_key", 1008)
    reply, code = _session(keyed_server, {"type": "start", "api_key": "wrong"})
    assert (reply["code"], code) == ("invalid_api_key", 1008)
    assert _session(keyed_server, {"type": "start", "api_key": KEY})[0]["type"] == "started"
    headers = {"Authorization": f"Bearer {KEY}"}
    assert _session(keyed_server, {"type": "start"}, headers)[0]["type"] == "started"


def test_a_large_first_message_without_the_key_is_refused_unread(keyed_server):
    """Until the key is given a message may hold 64 KiB, so a key-less client cannot make the
    server parse megabytes; with the key in the handshake the same start is read."""
    big = {"type": "start", "api_key": "wrong", "pad": "x" * (1 << 20)}
    reply, code = _session(keyed_server, big)
    assert (reply["code"], code) == ("message_too_big", 1009)
    assert "before the API key is given" in reply["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    reply, code = _session(keyed_server, {**big, "api_key": KEY}, headers)
    assert (reply["code"], code) == ("bad_start", 1008) and "pad" in reply["message"]


def _readme_access_table() -> dict[str, bool]:
    """The README's access table: path -> whether it needs the key."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("| path | key | what it is |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        path, key = (cell.strip() for cell in line.strip("|").split("|")[:2])
        if path.startswith("`GET "):
            rows[path.strip("`").removeprefix("GET ")] = key == "needed"
    return rows


def test_the_paths_open_without_the_key_are_those_the_readme_lists(keyed_server):
    table = _readme_access_table()
    assert table == {"/health": False, "/": False, "/static/*": False}
    for path in ("/health", "/", "/static/app.js", "/static/style.css"):
        assert httpx.get(keyed_server.url + path).status_code == 200, path
    for path in ("/v1/models", "/metrics", "/v1/samples", "/static/../v1/models"):
        assert httpx.get(keyed_server.url + path).status_code in (401, 404), path
