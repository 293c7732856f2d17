"""`stillcut describe` prints the answer, the EVS summary, timings, the weights' stored format
and the random-weights notice (or one JSON object); `stillcut serve` turns its flags into the
server's settings, the precision flags included."""

import json

import pytest
import torch

from stillcut.service import cli, cli_serve, server
from stillcut.service.cli_describe import DEFAULT_MAX_TOKENS
from stillcut.service.cli_options import RANDOM_WEIGHTS_NOTICE

MiB = 2**20


@pytest.fixture
def clip_path(tiny_clip, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    return path


def test_describe_prints_the_answer_and_its_costs(tiny_checkpoint, clip_path, capsys):
    argv = ["describe", str(clip_path), "--model", str(tiny_checkpoint), "--max-tokens", "3"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "kept" in lines["EVS"] and "evs:rate:q=0.75" in lines["EVS"]
    assert "generated 3" in lines["tokens"]
    for stage in ("load model", "decode", "encode", "queue", "ttft", "total"):
        assert f"{stage} " in lines["timings"]
    assert RANDOM_WEIGHTS_NOTICE in err


def test_describe_json_with_threshold_evs(tiny_checkpoint, clip_path, capsys):
    argv = [
        *("describe", str(clip_path), "--model", str(tiny_checkpoint), "--json"),
        *("--evs-threshold", "0.05", "--max-tokens", "2", "--prompt", "What moves?"),
        *("--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16", "--compute-dtype", "bfloat16"),
    ]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    memory = report["memory"]
    assert (memory["weight_format"], memory["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
    assert memory["arithmetic"] == {"dtype": "bfloat16", "reason": "set by compute_dtype"}
    assert 0 < memory["vision_weight_bytes"] < memory["weight_bytes"]
    assert report["evs"]["setting"].startswith("evs:threshold:tau=0.05")
    assert report["usage"]["completion_tokens"] == 2
    assert len(report["frame_timestamps"]) == report["evs"]["frames"] == 6


def test_inspect_says_which_arithmetic_its_tower_ran(
    tiny_checkpoint, clip_path, capsys, monkeypatch
):
    monkeypatch.setenv("STILLCUT_CPU_FLAGS", "avx512_bf16")  # float32 weights: auto is float32
    argv = ["inspect", str(clip_path), "--model", str(tiny_checkpoint)]
    assert cli.main(argv) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "float32 (auto: weights stored in float32, not bfloat16)" in lines["arithmetic"]
    assert cli.main([*argv, "--json", "--compute-dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arithmetic"] == {"dtype": "bfloat16", "reason": "set by compute_dtype"}


def test_inspect_prunes_before_the_tower_with_evs_stage_pixels(tiny_checkpoint, clip_path, capsys):
    argv = ["inspect", str(clip_path), "--model", str(tiny_checkpoint), "--json"]
    assert cli.main([*argv, "--evs-rate", "0.5", "--evs-stage", "pixels"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["evs"]["setting"] == "evs:rate:q=0.5:stage=pixels"
    assert report["evs"]["tokens_kept"] == report["evs"]["tokens_total"] // 2


def test_describe_reports_bad_input(tmp_path, capsys):
    assert cli.main(["describe", str(tmp_path / "missing.mp4")]) == 2
    assert "is not a file" in capsys.readouterr().err
    video = tmp_path / "x.mp4"
    video.write_bytes(b"")  # the settings are refused before it is read
    assert cli.main(["describe", str(video), "--quantization-skip", "lm_head"]) == 2
    assert "quantization_skip=('lm_head',) needs a quantization" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["describe", "x.mp4", "--evs-rate", "0.5", "--evs-threshold", "0.1"])
    args = cli.build_parser().parse_args(["describe", "x.mp4"])
    assert args.max_tokens == DEFAULT_MAX_TOKENS and args.prompt == "Describe this video."


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("describe", ("--fps", "0"), "--fps 0 must be a finite number > 0"),
        ("describe", ("--evs-rate", "1"), "--evs-rate 1 must be in [0, 1)"),
        ("describe", ("--start", "5", "--end", "2"), "--end 2 must be after --start 5"),
        ("describe", ("--max-tokens", "0"), "--max-tokens 0 must be in [1, "),
        ("describe", ("--temperature", "-1"), "--temperature -1 must be in [0, 100]"),
        ("inspect", ("--max-frames", "0"), "--max-frames 0 must be an integer >= 1"),
        ("narrate", ("--evs-threshold", "3"), "--evs-threshold 3 must be in [0, 2]"),
        ("describe", ("--evs-stage", "pixels"), "--evs-stage pixels needs --evs-rate or"),
        ("inspect", ("--evs-stage", "pixels", "--no-evs"), "--evs-stage pixels needs"),
    ],
)
def test_bad_flag_values_are_refused_in_their_own_name_before_the_model_loads(
    command, flags, message, tmp_path, capsys, monkeypatch
):
    from stillcut.service import api

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api.VideoLLM, "__init__", no_model)
    video = tmp_path / "x.mp4"
    video.write_bytes(b"")
    assert cli.main([command, str(video), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Config." not in err, err


def test_the_first_native_compile_says_so_on_stderr(tmp_path, monkeypatch, capsys):
    from stillcut.kernels.cpu import library

    def fails(*arguments):
        raise OSError("no compiler here")

    monkeypatch.setenv("STILLCUT_CACHE", str(tmp_path))
    monkeypatch.setattr(library, "_compile", fails)
    library.load.cache_clear()
    try:
        assert library.load() is None
    finally:
        library.load.cache_clear()  # the next caller builds (or finds) the real library
    err = capsys.readouterr().err
    assert "compiling the native CPU decode step for this machine, once" in err
    assert str(tmp_path / "native") in err


def test_serve_turns_flags_into_settings(tiny_checkpoint, tmp_path, monkeypatch):
    served = {}
    monkeypatch.setattr(
        server, "serve", lambda llm, config, **where: served.update(where, llm=llm, config=config)
    )
    argv = [
        *("serve", "--model", str(tiny_checkpoint), "--port", "9999", "--api-key", "k"),
        *("--media-dir", str(tmp_path), "--allowed-hosts", "a.example, b.example:8080"),
        *("--max-upload-mb", "2", "--max-queue", "5", "--kv-cache-memory", "4"),
        *("--max-model-len", "1024", "--max-sessions", "2", "--limit-frames", "100"),
        *("--limit-fps", "4", "--limit-mm-per-prompt", "3", "--body-timeout", "10"),
        *("--max-connections", "50", "--max-image-pixels", "1000000"),
        *("--allowed-origins", "https://app.example"),
        *("--quantization", "int8", "--quantization-skip", "lm_head"),
        *("--max-prefill-chunk", "128", "--session-idle", "15"),
    ]
    assert cli.main(argv) == 0
    config, llm = served["config"], served["llm"]
    assert (served["host"], served["port"]) == ("127.0.0.1", 9999)
    assert config.api_key == "k" and config.media_dir == tmp_path
    assert config.allowed_hosts == ("a.example", "b.example:8080")
    assert (config.max_upload_bytes, config.max_queue, config.max_sessions) == (2 * MiB, 5, 2)
    assert (config.limit_frames, config.limit_fps, config.limit_mm_per_prompt) == (100, 4, 3)
    assert (config.body_timeout_s, config.max_connections) == (10, 50)
    assert config.allowed_origins == ("https://app.example",)
    assert config.trusted_hosts == ("localhost", "127.0.0.1", "::1")
    assert llm.pipeline.decode_config.max_image_pixels == 1_000_000
    assert llm.engine.config.cache.kv_cache_memory == 4 * MiB
    assert llm.engine.config.scheduler.max_model_len == 1024
    assert llm.engine.config.scheduler.max_prefill_tokens_per_request == 128
    assert config.session_idle_s == 15
    assert llm.engine.memory.weight_format == "int8 (float32, lm_head kept)"
    assert llm.engine.model.lm_head.dtype == torch.float32  # the skipped head
    assert llm.engine.model.layers[0].qkv_weight.dtype == torch.int8


@pytest.mark.parametrize(
    ("flags", "trusted"),
    [
        (("--host", "0.0.0.0"), ("localhost", "127.0.0.1", "::1")),
        (("--host", "::"), ("localhost", "127.0.0.1", "::1")),
        (("--host", "10.1.2.3"), ("localhost", "127.0.0.1", "::1", "10.1.2.3")),
        (("--trusted-hosts", "api.example, *"), ("api.example", "*")),
    ],
)
def test_serve_trusts_the_local_names_and_its_own_host(flags, trusted):
    args = cli.build_parser().parse_args(["serve", *flags])
    assert cli_serve._trusted_hosts(args.trusted_hosts, args.host) == trusted


def test_inspect_prints_the_source_duration_and_the_range_apart(tiny_checkpoint, clip_path, capsys):
    argv = ["inspect", str(clip_path), "--model", str(tiny_checkpoint)]
    assert cli.main([*argv, "--start", "1", "--end", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"]["duration_s"] == pytest.approx(3.0)  # the whole clip
    assert report["range"] == {"start_s": 1.0, "end_s": 2.0}
    assert cli.main([*argv, "--start", "1"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["source"].endswith("3.00 s") and lines["range"].endswith("1.00-3.00 s")
