"""The EVS setting of a request that names none: the request's own `evs`, else what the
operator configured (`VideoLLM(evs=)`, the CLI's and the server's `--evs-rate`,
`--evs-threshold`, `--no-evs`), else the checkpoint's own pruning rate where its family has one
(0: EVS off), else rate 0.75. The server says which applies in /health and /v1/models."""

import dataclasses
import json
import shutil

import httpx
import pytest

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.families import FAMILIES
from stillcut.engine.models.qwen2_vl.entry import QWEN2_5_VL
from stillcut.kernels.evs import EVSConfig
from stillcut.service import cli, server
from stillcut.service.api import VideoLLM, describe_video
from stillcut.service.config import ServerConfig
from stillcut.service.server import BackgroundServer

from .conftest import ENGINE_CONFIG, data_url

MODEL_TYPE = "toy_native_evs"
# the tiny Qwen2.5-VL under another model_type whose family reads the checkpoint's own rate
NATIVE = dataclasses.replace(
    QWEN2_5_VL,
    model_type=MODEL_TYPE,
    native_evs_rate=lambda raw: float(raw["video_pruning_rate"]),
)
THRESHOLD = EVSConfig(mode="threshold", threshold=0.2)


@pytest.fixture(scope="module")
def native_checkpoints(tmp_path_factory):
    """{rate: checkpoint folder} for a checkpoint asking for rate 0.5, and one asking for 0."""
    folders = {}
    for rate in (0.5, 0.0):
        folder = tmp_path_factory.mktemp("native") / "checkpoint"
        shutil.copytree(cached_checkpoint("tiny", seed=0), folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type=MODEL_TYPE, video_pruning_rate=rate)
        (folder / "config.json").write_text(json.dumps(config))
        folders[rate] = folder
    with FAMILIES.registered(NATIVE):
        yield folders


@pytest.fixture(scope="module")
def clip_path(tiny_clip, tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    path.write_bytes(tiny_clip)
    return path


def test_the_order_of_precedence_in_the_python_api(native_checkpoints, tiny_checkpoint, clip_path):
    native = VideoLLM(native_checkpoints[0.5], engine_config=ENGINE_CONFIG)
    assert native.evs_default.to_dict() == {"setting": "evs:rate:q=0.5", "source": "checkpoint"}
    assert native.describe(clip_path, max_tokens=1).evs.setting == "evs:rate:q=0.5"
    assert native.describe(clip_path, max_tokens=1, evs=None).evs.setting == "off"  # the call's
    asked = native.describe(clip_path, max_tokens=1, evs=THRESHOLD).evs.setting
    assert asked == THRESHOLD.key()
    configured = VideoLLM(native_checkpoints[0.5], engine_config=ENGINE_CONFIG, evs=THRESHOLD)
    assert configured.evs_default.to_dict() == {"setting": THRESHOLD.key(), "source": "configured"}
    assert configured.describe(clip_path, max_tokens=1).evs.setting == THRESHOLD.key()
    switched_off = VideoLLM(native_checkpoints[0.0], engine_config=ENGINE_CONFIG)
    assert switched_off.evs_default.to_dict() == {"setting": "off", "source": "checkpoint"}
    assert switched_off.describe(clip_path, max_tokens=1).evs.setting == "off"
    plain = VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)
    assert plain.evs_default.to_dict() == {"setting": "evs:rate:q=0.75", "source": "built-in"}
    assert describe_video(clip_path, model=native_checkpoints[0.5], max_tokens=1).evs.setting == (
        "evs:rate:q=0.5"
    )
    with pytest.raises(ValueError, match="EVSConfig, None"):
        plain.describe(clip_path, evs="off")


@pytest.mark.parametrize(
    ("flags", "setting", "source"),
    [
        ((), "evs:rate:q=0.5", "checkpoint"),
        (("--evs-rate", "0.3"), "evs:rate:q=0.3", "configured"),
        (("--no-evs",), "off", "configured"),
    ],
)
def test_inspect_and_describe_follow_the_same_order(
    native_checkpoints, clip_path, capsys, flags, setting, source
):
    model = str(native_checkpoints[0.5])
    assert cli.main(["inspect", str(clip_path), "--model", model, "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["evs"]["setting"], report["evs"]["source"]) == (setting, source)
    argv = ["describe", str(clip_path), "--model", model, "--json", "--max-tokens", "1", *flags]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["evs"]["setting"] == setting


def test_the_server_uses_and_reports_its_default(native_checkpoints, tiny_clip):
    llm = VideoLLM(native_checkpoints[0.5], engine_config=ENGINE_CONFIG)
    background = BackgroundServer(llm, ServerConfig())
    try:
        expected = {"setting": "evs:rate:q=0.5", "source": "checkpoint"}
        assert httpx.get(f"{background.url}/health").json()["evs_default"] == expected
        (model,) = httpx.get(f"{background.url}/v1/models").json()["data"]
        assert model["evs_default"] == expected
        parts = [{"type": "video_url", "video_url": {"url": data_url(tiny_clip)}}]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
        chat = f"{background.url}/v1/chat/completions"
        assert httpx.post(chat, json=body, timeout=60).json()["evs"]["setting"] == "evs:rate:q=0.5"
        own = httpx.post(chat, json={**body, "evs": "off"}, timeout=60).json()
        assert own["evs"]["setting"] == "off"  # the request's own evs comes first
        files = {"file": ("clip.mp4", tiny_clip, "video/mp4")}
        described = httpx.post(
            f"{background.url}/v1/videos/describe", files=files, data={"max_tokens": 1}, timeout=60
        )
        assert described.json()["evs"]["setting"] == "evs:rate:q=0.5"
    finally:
        background.stop()


def test_serve_takes_the_evs_flags(native_checkpoints, monkeypatch):
    served = {}
    monkeypatch.setattr(server, "serve", lambda llm, config, **where: served.update(llm=llm))
    argv = ["serve", "--model", str(native_checkpoints[0.5]), "--evs-threshold", "0.2"]
    assert cli.main(argv) == 0
    assert served["llm"].evs_default.to_dict() == {
        "setting": THRESHOLD.key(),
        "source": "configured",
    }
