"""A live session's inbox: an answer that has ended is seen before a message that arrived with
it, so an `ask` sent right after an answer is not refused as `busy`, and no message is lost."""

import asyncio
import json

from stillcut.service.config import ServerConfig
from stillcut.service.live_inbox import CLOSE_POLICY, Inbox, SessionEnd

ASK = {"type": "ask", "prompt": "And now?"}


class _ArrivedSocket:
    """A socket whose next message has already arrived."""

    async def receive(self) -> dict:
        return {"type": "websocket.receive", "text": json.dumps(ASK)}


def test_an_ended_answer_comes_before_a_message_that_arrived_with_it():
    async def both_ready() -> tuple:
        inbox = Inbox(_ArrivedSocket(), ServerConfig(), authenticated=True)
        late = SessionEnd(CLOSE_POLICY, "late")
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(None)  # the answer has ended
        return await inbox.next(None, late, answer), await inbox.next(None, late)

    assert asyncio.run(both_ready()) == (None, ASK)
