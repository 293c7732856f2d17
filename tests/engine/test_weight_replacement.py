"""An engine whose model is given another checkpoint's weights decodes that checkpoint's tokens.

The native decode step reads weights by address and the torch ops through banded views, both
made once; here the running model's weights are replaced by those of a second checkpoint of
the same shapes (as a reload would: new parameters, `load_state_dict(assign=True)`, or
`param.data = ...`), the old tensors are dropped, and greedy decoding must equal transformers'
`generate` on the second checkpoint, with the native step doing the decoding.
"""

import gc

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.processor import PromptProcessor
from stillcut.engine.request import SamplingParams
from stillcut.kernels.cpu import decoder as native_decoder
from stillcut.kernels.cpu import library

NUM_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
PROMPT = "Tell me about the sea."
# wider than the presets' 0.02, so that the tiny models' greedy tokens vary from step to step
TEXT = {"initializer_range": 0.1}
FAMILIES = ("qwen2_5_vl", "gemma3")


def _new_parameters(model, other) -> None:
    for name, param in other.named_parameters():
        path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(path), attribute, param)


def _assign_state_dict(model, other) -> None:
    model.load_state_dict(other.state_dict(), assign=True)


def _repoint_data(model, other) -> None:
    replacements = dict(other.named_parameters())
    for name, param in model.named_parameters():
        param.data = replacements[name].data


REPLACEMENTS = {
    "new parameters": _new_parameters,
    "load_state_dict(assign=True)": _assign_state_dict,
    "param.data": _repoint_data,
}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request):
    """(family, first checkpoint, second checkpoint, transformers' greedy tokens of the
    second)."""
    from transformers import AutoModelForImageTextToText

    first = cached_checkpoint("tiny", seed=1, family=request.param, text=TEXT)
    second = cached_checkpoint("tiny", seed=3, family=request.param, text=TEXT)
    prompt = PromptProcessor.from_checkpoint(second).build_text(PROMPT)
    reference = AutoModelForImageTextToText.from_pretrained(second, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = reference.generate(
            input_ids=torch.tensor([prompt.token_ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return request.param, first, second, out[0, len(prompt.token_ids) :].tolist()


def _config() -> EngineConfig:
    # no prefix caching: blocks cached before the swap hold the first checkpoint's K/V
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=512),
        cache=CacheConfig(num_blocks=64, block_size=16, enable_prefix_caching=False),
    )


@pytest.mark.parametrize("how", list(REPLACEMENTS))
def test_replaced_weights_decode_their_own_tokens(checkpoints, how, monkeypatch):
    if library.load() is None:
        pytest.skip("no C compiler: the native CPU decode kernel is not built")
    _, first, second, expected = checkpoints
    engine = LLMEngine(first, _config())
    prompt = engine.processor.build_text(PROMPT)
    (before,) = engine.generate([prompt], GREEDY)
    assert before.token_ids != expected  # the two checkpoints really decode differently

    REPLACEMENTS[how](engine.model, type(engine.model).from_checkpoint(second))
    gc.collect()  # the first checkpoint's tensors have no owner left but the decoder
    native_rows = []
    decode = native_decoder.CpuDecoder.decode

    def counted(decoder, input_ids, *args):
        native_rows.append(input_ids.shape[0])
        return decode(decoder, input_ids, *args)

    monkeypatch.setattr(native_decoder.CpuDecoder, "decode", counted)
    (after,) = engine.generate([prompt], GREEDY)
    assert after.token_ids == expected
    assert len(set(expected)) > 1  # not one token over and over
    assert len(native_rows) == NUM_NEW_TOKENS - 1  # every decode step ran natively
