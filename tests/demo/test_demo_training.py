"""The demo trainer: its tokenizer, its inputs, and a few steps that must be reproducible.

CI never retrains the shipped checkpoint; these tests run the real trainer for a few steps on
a handful of clips, twice, and check that the same seed gives the same bytes, that what it
saves is a checkpoint transformers and stillcut both load, that the answer stage trains the
language model alone on what the tower stage's tower makes of each clip, and that the frames it
trains on are the ones the service's preprocessing would make.
"""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from stillcut.demo import architecture
from stillcut.demo.clips import clip_bytes, training_seeds
from stillcut.demo.scenes import sample_scene
from stillcut.demo.sequences import EVSSchedule
from stillcut.demo.train import DemoTrainer, TrainConfig, train_checkpoint
from stillcut.demo.training_data import model_frames, training_clips
from stillcut.engine.factory.qwen_tokenizer import ADDED_TOKENS
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.qwen2_vl.preprocess import VideoPreprocessConfig, preprocess_video
from stillcut.engine.processor import PromptProcessor
from stillcut.engine.request import SamplingParams
from stillcut.service.evs_default import DEFAULT_EVS
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.pipeline import VisionPipeline

FEW_STEPS = TrainConfig(
    num_clips=6,
    num_narration_clips=2,
    vision_steps=2,
    steps=3,
    clips_per_step=2,
    questions_per_clip=2,
    log_every=1,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folders = [tmp_path_factory.mktemp("demo") / "checkpoint" for _ in range(2)]
    train_checkpoint(folders[0], FEW_STEPS, save_tower_stage=_tower_stage(folders[0]))
    train_checkpoint(folders[1], FEW_STEPS)
    return folders


def _tower_stage(folder):
    return folder.parent / "tower-stage.pt"


def test_same_seed_same_checkpoint(trained, tmp_path):
    first, second = trained
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = tmp_path / "other-seed"
    train_checkpoint(other, TrainConfig(**{**FEW_STEPS.__dict__, "seed": 1}))
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_a_saved_tower_stage_gives_the_full_runs_checkpoint(trained, tmp_path):
    """The first run saved its tower stage; a run from it makes the same weights, and a recipe
    whose tower stage differs is refused."""
    stage = _tower_stage(trained[0])
    resumed = tmp_path / "resumed"
    train_checkpoint(resumed, FEW_STEPS, tower_stage=stage)
    expected = (trained[0] / "model.safetensors").read_bytes()
    assert (resumed / "model.safetensors").read_bytes() == expected
    with pytest.raises(ValueError, match="vision_steps"):
        other = TrainConfig(**{**FEW_STEPS.__dict__, "vision_steps": 3})
        train_checkpoint(tmp_path / "refused", other, tower_stage=stage)
    assert not (tmp_path / "refused").exists()


def test_checkpoint_loads_in_transformers_and_stillcut(trained):
    from transformers import AutoModelForImageTextToText

    folder = trained[0]
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.dtype == torch.bfloat16
    config = json.loads((folder / "config.json").read_text())
    assert config["stillcut_demo"]["recipe"]["steps"] == FEW_STEPS.steps
    assert "stillcut_random_weights" not in config
    engine = LLMEngine(folder)
    pipeline = VisionPipeline(folder)
    item = pipeline.video(clip_bytes(sample_scene(0)))
    assert item.llm_grid == (6, 6, 8)  # every 4:3 clip is resized to 224x168
    prompt = engine.processor.build_text("Describe this video.", [item])
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.token_ids) == 4


def test_answer_stage_trains_the_language_model_on_the_frozen_towers_embeddings(tmp_path):
    architecture.write_skeleton(tmp_path, {})
    trainer = DemoTrainer(tmp_path, FEW_STEPS)
    clips = training_clips(training_seeds(FEW_STEPS.num_clips), trainer.preprocess)
    rng = np.random.default_rng(0)
    trainer.train_tower(clips, rng)
    tower = {k: v.clone() for k, v in trainer.tower.state_dict().items()}
    language_model = {k: v.clone() for k, v in trainer.language_model.state_dict().items()}
    encoded = trainer.encode(clips)
    with torch.no_grad():
        mirrored_frames = np.ascontiguousarray(clips[0].frames[:, :, ::-1])
        video = preprocess_video(mirrored_frames, DecodeConfig().fps, trainer.preprocess)
        expected = trainer.tower(video.patches, torch.tensor([video.grid_thw]))
    torch.testing.assert_close(encoded[0].mirrored_embeds, expected)
    trainer.train_answers(encoded, rng)
    for name, value in trainer.tower.state_dict().items():
        assert torch.equal(value, tower[name]), name
    changed = [
        k
        for k, v in trainer.language_model.state_dict().items()
        if not torch.equal(v, language_model[k])
    ]
    assert changed


def test_tokenizer_is_small_and_qwen_shaped(trained):
    folder = trained[0]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert (folder / "tokenizer.json").stat().st_size < 100_000
    first_added = tokenizer.token_to_id(ADDED_TOKENS[0][0])
    for offset, (text, _) in enumerate(ADDED_TOKENS):
        assert tokenizer.token_to_id(text) == first_added + offset
    config = json.loads((folder / "config.json").read_text())
    assert config["video_token_id"] == tokenizer.token_to_id("<|video_pad|>")
    assert config["text_config"]["vocab_size"] >= tokenizer.get_vocab_size()
    for text in ("A red circle moves up.", "héllo wörld 日本 😀\r\n\ttabs", "<|im_start|>x"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    sentence = tokenizer.encode(" an orange triangle appears", add_special_tokens=False)
    assert len(sentence.ids) == 4  # the task's words are whole tokens


def test_prompt_is_qwen_chat_format_and_transformers_tokenizes_it_alike(trained):
    from transformers import AutoTokenizer

    folder = trained[0]
    processor = PromptProcessor.from_checkpoint(folder)
    text = processor.chat_template.render(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}]
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|video_pad|><|vision_end|>What moves?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    theirs = AutoTokenizer.from_pretrained(folder)
    assert theirs(text, add_special_tokens=False).input_ids == processor.encode(text)
    assert theirs.eos_token_id in processor.special.eos_token_ids


def test_training_frames_patchify_like_the_service_preprocessing(trained):
    config = VideoPreprocessConfig.from_checkpoint(trained[0])
    assert config.min_pixels == config.max_pixels == architecture.INPUT_PIXELS
    data = clip_bytes(sample_scene(5, fps=2))
    frames = model_frames(data, config)
    assert frames.shape == (12, architecture.INPUT_HEIGHT, architecture.INPUT_WIDTH, 3)
    decoded = decode_video(data, DecodeConfig())
    ours = preprocess_video(frames, decoded.sample_fps, config)
    service = preprocess_video(decoded.frames, decoded.sample_fps, config)
    assert torch.equal(ours.patches, service.patches)


def test_evs_schedule_mixes_unpruned_and_pruned_sequences():
    rng = np.random.default_rng(0)
    draws = [EVSSchedule(unpruned_share=0.3, max_value=0.95).draw(rng) for _ in range(2000)]
    unpruned = sum(d is None for d in draws) / len(draws)
    rates = [d.rate for d in draws if d is not None]
    assert 0.25 < unpruned < 0.35
    assert all(d.mode == "rate" for d in draws if d is not None)
    assert min(rates) < 0.05 and 0.9 < max(rates) < 0.95
    narration = EVSSchedule(unpruned_share=0.2, max_value=0.3, mode="threshold")
    taus = [d.threshold for d in (narration.draw(rng) for _ in range(500)) if d is not None]
    assert 0.25 < max(taus) < 0.3 and len(taus) < 450
    with pytest.raises(ValueError, match="max_value"):
        EVSSchedule(max_value=1.0)
    # the recipe's schedule trains a quarter of its sequences at the service's default rate
    schedule = TrainConfig().evs
    draws = [schedule.draw(rng) for _ in range(4000)]
    at_default = sum(d is not None and d.key() == DEFAULT_EVS.key() for d in draws) / len(draws)
    assert 0.22 < at_default < 0.28
    assert 0.27 < sum(d is None for d in draws) / len(draws) < 0.33
    with pytest.raises(ValueError, match="default_share"):
        EVSSchedule(unpruned_share=0.8, default_share=0.3)
    with pytest.raises(ValueError, match="default_value"):
        EVSSchedule(default_value=1.0)
    with pytest.raises(ValueError, match="evs must be"):
        TrainConfig(evs=narration)


def test_token_labels_name_the_ground_of_every_token_and_mirror_left_and_right():
    from stillcut.demo.scenes import MOTIONS
    from stillcut.demo.token_labels import GROUNDS, NUM_LABELS, mirrored_labels, token_labels

    seeds = (0, 4, 7)  # flat moving down, textured and still, moving left
    for seed in seeds:
        scene = sample_scene(seed, fps=2)
        labels = token_labels(scene, [k / 2 for k in range(12)], (6, 8))
        assert labels.shape == (6, 6, 8, NUM_LABELS)
        assert (labels[..., 3] == GROUNDS.index(scene.ground)).all()
        flipped = mirrored_labels(labels)
        np.testing.assert_array_equal(flipped[..., 3], labels[..., 3])
        np.testing.assert_array_equal(flipped[..., :2], labels[:, :, ::-1, :2])
        if scene.motion in ("left", "right"):
            moving = labels[..., 2] == MOTIONS.index(scene.motion)
            assert moving.any()
            assert (flipped[:, :, ::-1][..., 2][moving] != MOTIONS.index(scene.motion)).all()
    assert {sample_scene(seed).ground for seed in seeds} == set(GROUNDS)


def test_rendering_processes_make_the_same_clips_in_order(trained, monkeypatch):
    import stillcut.demo.training_data as training_data

    monkeypatch.setattr(training_data, "_BATCH", 2)  # three batches over two processes
    config = VideoPreprocessConfig.from_checkpoint(trained[0])
    seeds = training_seeds(5)
    alone = training_clips(seeds, config)
    shared = training_clips(seeds, config, workers=2)
    assert [c.scene for c in shared] == [c.scene for c in alone]
    for ours, theirs in zip(shared, alone, strict=True):
        assert np.array_equal(ours.frames, theirs.frames)
        assert np.array_equal(ours.labels, theirs.labels)
    with pytest.raises(ValueError, match="workers=0"):
        training_clips(seeds, config, workers=0)


def test_a_token_two_objects_share_names_both_as_present():
    """The colour and shape labels name the object covering most of a token; the present-pairs
    mask names every object covering a tenth of it, so where two objects meet the tower is
    taught to keep both."""
    from stillcut.demo.token_labels import (
        COLOUR_CLASSES,
        SHAPE_CLASSES,
        pair_index,
        present_pairs,
        token_labels,
    )

    shared = 0
    for seed in range(40):
        scene = sample_scene(seed, fps=2)
        labels = token_labels(scene, [k / 2 for k in range(12)], (6, 8))
        pairs = present_pairs(labels[..., 4])
        owned = labels[..., 0] != COLOUR_CLASSES - 1
        labelled_pair = np.where(owned, labels[..., 0] * (SHAPE_CLASSES - 1) + labels[..., 1], 0)
        assert (np.take_along_axis(pairs, labelled_pair[..., None], -1)[owned] == 1).all()
        for obj in scene.objects:
            bit = pairs[..., pair_index(obj.colour, obj.shape)]
            assert bit.any()  # every object is present somewhere
        shared += int((pairs.sum(-1) >= 2).sum())
    assert shared > 0  # some tokens show two objects at once
