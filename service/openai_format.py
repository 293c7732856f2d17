"""Engine outputs in the OpenAI chat-completions shapes: a whole completion, or stream chunks.

Besides the standard fields, a response carries `evs` (what EVS kept of the request's videos)
next to `usage`, and, as vLLM's do, each finished choice its `stop_reason`: the stop string or
stop token id that ended it, None for EOS or length. OpenAI clients keep unknown fields, so it
costs them nothing. With a reasoning parser the model's thinking goes to `reasoning_content`
(streamed as `delta.reasoning_content`), the rest to `content`.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from tokenizers import Tokenizer

from stillcut.engine.llm_engine import RequestOutput
from stillcut.service.reasoning import ThinkSplitter
from stillcut.service.result import EVSSummary, usage_of


def usage_body(output: RequestOutput) -> dict[str, Any]:
    usage = usage_of(output)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


def logprobs_body(
    tokenizer: Tokenizer, output: RequestOutput, start: int, end: int
) -> dict[str, Any]:
    """OpenAI `logprobs` for the generated tokens `[start, end)` of `output`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, (top_ids, top_logprobs, logprob) in zip(
        output.token_ids[start:end], output.logprobs[start:end], strict=True
    ):
        top = [entry(t, lp) for t, lp in zip(top_ids, top_logprobs, strict=True)]
        content.append({**entry(token_id, logprob), "top_logprobs": top})
    return {"content": content}


class ChatFormatter:
    """Builds the responses of one chat request (`completion`, or `chunks` per output)."""

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        logprobs: bool,
        include_usage: bool,
        evs: EVSSummary | None,
        reasoning: ThinkSplitter | None = None,
    ) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.evs = evs
        self.reasoning = reasoning
        self._num_sent = 0  # tokens whose logprobs went out in earlier chunks
        self._started = False

    def completion(self, output: RequestOutput) -> dict[str, Any]:
        """The whole `chat.completion` object for a finished request."""
        message = {"role": "assistant", "content": output.text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning.split(output.text)
            message["reasoning_content"] = reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(output, 0),
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        return {**self._head("chat.completion"), "choices": [choice], **self._usage(output)}

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The `chat.completion.chunk`s for one more output: the role first, then text, then
        the finish reason, then (when asked for) one chunk with the usage and no choices."""
        chunks = []
        if not self._started:
            self._started = True
            chunks.append(self._chunk({"role": "assistant", "content": ""}))
        logprobs = self._logprobs(output, self._num_sent)
        self._num_sent = len(output.token_ids)
        delta = self._delta(output)
        if delta or (logprobs and logprobs["content"]):
            chunks.append(self._chunk(delta or {"content": ""}, logprobs=logprobs))
        if output.finished:
            chunks.append(self._chunk({}, finish_reason=output.finish_reason))
            chunks[-1]["choices"][0]["stop_reason"] = output.stop_reason
            if self.include_usage:
                chunks.append({**self._head("chat.completion.chunk"), "choices": []})
                chunks[-1].update(self._usage(output))
        return chunks

    def _delta(self, output: RequestOutput) -> dict[str, str]:
        """The new text as a chunk's delta: `content`, or with a reasoning parser
        `reasoning_content` and / or `content` (empty when the parser holds the text back)."""
        if self.reasoning is None:
            return {"content": output.delta} if output.delta else {}
        reasoning, content = self.reasoning.push(output.delta)
        if output.finished:
            held_reasoning, held_content = self.reasoning.flush()
            reasoning, content = reasoning + held_reasoning, content + held_content
        fields = (("reasoning_content", reasoning), ("content", content))
        return {name: text for name, text in fields if text}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(
        self, delta: dict, *, logprobs: dict | None = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def _logprobs(self, output: RequestOutput, start: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return logprobs_body(self.tokenizer, output, start, len(output.token_ids))

    def _usage(self, output: RequestOutput) -> dict[str, Any]:
        extra = {} if self.evs is None else {"evs": asdict(self.evs)}
        return {"usage": usage_body(output), **extra}
