"""`stillcut narrate`: one line per segment, in order; rate-mode EVS is not offered; the EVS
stage is."""

import pytest

from stillcut.service.cli import build_parser, main


def test_narrate_prints_one_line_per_tubelet(tiny_checkpoint, tiny_clip, tmp_path, capsys):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    argv = ["narrate", str(path), "--model", str(tiny_checkpoint), "--no-evs"]
    assert main([*argv, "--max-tokens-per-segment", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == [
        "[   0.0-   0.5s",
        "[   1.0-   1.5s",
        "[   2.0-   2.5s",
    ]


def test_narrate_offers_no_rate_mode_evs_and_explains_lag(capsys):
    with pytest.raises(SystemExit):
        main(["narrate", "x.mp4", "--evs-rate", "0.5"])
    assert "unrecognized arguments: --evs-rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["narrate", "--help"])
    usage = capsys.readouterr().out
    assert "--evs-rate" not in usage and "skips to the newest" in usage


def test_narrate_prunes_before_the_tower_with_evs_stage_pixels(
    tiny_checkpoint, tiny_clip, tmp_path, capsys
):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    argv = ["narrate", str(path), "--model", str(tiny_checkpoint), "--evs-stage", "pixels"]
    assert main([*argv, "--max-tokens-per-segment", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[   0.0-   0.5s]")  # the first tubelet is kept whole


def test_narrate_refuses_a_stage_without_evs_before_loading(tmp_path, capsys):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"not read")
    assert main(["narrate", str(path), "--evs-stage", "pixels", "--no-evs"]) == 2
    assert "--evs-stage pixels needs EVS: drop --no-evs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["narrate", "--help"])
    assert "--evs-stage" in capsys.readouterr().out
