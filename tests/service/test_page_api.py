"""What the web page needs from the API, over plain HTTP: `include_frames` on describe (and
nothing new without it), the sample routes, and the page's files served without a key."""

import base64
import io

import httpx
from PIL import Image

from stillcut.service.config import ServerConfig
from stillcut.service.page_routes import SAMPLES_DIR

from .conftest import running_server

MAX_TOKENS = 3


def _describe(main_server, **fields) -> dict:
    files = {"file": ("clip.mp4", main_server.clip, "video/mp4")}
    data = {"max_tokens": MAX_TOKENS, **fields}
    response = httpx.post(
        f"{main_server.url}/v1/videos/describe", files=files, data=data, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_include_frames_adds_thumbnails_and_masks_that_match_evs(main_server):
    plain = _describe(main_server)
    assert "frames" not in plain
    body = _describe(main_server, include_frames="true", evs='{"mode": "rate", "rate": 0.5}')
    frames = body["frames"]
    t, h, w = frames["grid"]
    assert len(frames["thumbnails"]) == body["evs"]["frames"] == 6
    assert t == len(frames["retention"]) == 3 and frames["frames_per_tubelet"] == 2
    kept = [sum(map(sum, mask)) for mask in frames["retention"]]
    assert kept == body["evs"]["kept_per_tubelet"]
    assert all(frames["retention"][0][i] == [1] * w for i in range(h))  # first tubelet: all kept
    image = Image.open(io.BytesIO(base64.b64decode(frames["thumbnails"][0])))
    assert image.format == "JPEG" and image.width == 160


def test_samples_are_listed_and_served_by_name_only(main_server):
    listed = httpx.get(f"{main_server.url}/v1/samples").json()["samples"]
    assert listed == sorted(path.name for path in SAMPLES_DIR.glob("*.mp4"))
    if listed:
        served = httpx.get(f"{main_server.url}/v1/samples/{listed[0]}")
        assert served.content == (SAMPLES_DIR / listed[0]).read_bytes()
    missing = httpx.get(f"{main_server.url}/v1/samples/..%2Fpyproject.toml")
    assert missing.status_code == 404


def test_page_needs_no_key_but_the_api_does(tiny_checkpoint):
    with running_server(tiny_checkpoint, ServerConfig(api_key="secret")) as server:
        for path in ("/", "/static/app.js", "/static/style.css"):
            assert httpx.get(server.url + path).status_code == 200, path
        assert httpx.get(server.url + "/v1/samples").status_code == 401
        assert httpx.get(server.url + "/static/../v1/samples").status_code == 401
