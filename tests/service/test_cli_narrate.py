"""`stillcut narrate`: one line per segment, in order; rate-mode EVS is refused."""

from stillcut.service.cli import main


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


def test_narrate_refuses_rate_mode_evs(tiny_clip, tmp_path, capsys):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    assert main(["narrate", str(path), "--evs-rate", "0.5"]) == 2
    assert "--evs-rate is refused: rate mode is not causal" in capsys.readouterr().err
