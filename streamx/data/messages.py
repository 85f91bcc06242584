"""A conversation's messages in one form, whichever form the row has: OpenAI `messages` (role / content)
or ShareGPT `conversations` (from / value), checked message by message. `streamx run` tokenizes this form
(streamx.data.tokenize) and `streamx regenerate` plans its turns from it (streamx.regen.conversation), so the
two read a row alike."""

from __future__ import annotations

from typing import Any

# OpenAI `messages` roles and ShareGPT `conversations` speakers, to chat-template roles
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant", "tool": "tool"}
# message fields besides role and content that chat templates read: passed through as they are
TEMPLATE_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


class BadRow(Exception):
    """A row that cannot become a sample (or a regenerated row), with its reason (a data.tokenize
    REJECT_REASONS name) and a detail for people."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def conversation_of(record: dict) -> Any | None:
    """The row's conversation field as it is: `messages`, else `conversations`; None when it has neither.
    Arrow-backed datasets fill absent columns with None, so values are tested, not keys."""
    return record.get("messages") if record.get("messages") is not None else record.get("conversations")


def normalize(turns: Any, answers: bool = True) -> list[dict]:
    """Messages -> [{"role", "content", and the TEMPLATE_FIELDS it has}], roles as chat templates name them;
    raises BadRow for the first message that is not one. An assistant turn that only calls tools gets content
    "" (a template renders None as the text "None"). `answers` False: the assistant turns that call no tools
    are to be written anew (regenerate), so their content is not read and comes back None."""
    if not isinstance(turns, list):
        raise BadRow("unrecognised_row", f"conversation is {type(turns).__name__}, not a list")
    if not turns:
        raise BadRow("empty_conversation", "conversation has no messages")
    return [_message(i, turn, answers) for i, turn in enumerate(turns)]


def _message(i: int, turn: Any, answers: bool) -> dict:
    if not isinstance(turn, dict):
        raise BadRow("unrecognised_row", f"message {i} is {type(turn).__name__}, not an object")
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    if not isinstance(role, str) or role.lower() not in ROLES:
        raise BadRow("unknown_role", f"message {i} has role {role!r}")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if not answers and ROLES[role.lower()] == "assistant" and not turn.get("tool_calls"):
        return {"role": "assistant", "content": None}
    if content is None and turn.get("tool_calls"):  # an assistant turn that only calls tools
        content = ""
    if not isinstance(content, str):
        raise BadRow("non_string_content", f"message {i} ({role}) content is {type(content).__name__}")
    extra = {k: turn[k] for k in TEMPLATE_FIELDS if turn.get(k) is not None}  # not e.g. a per-message timestamp
    if not isinstance(extra.get("reasoning_content", ""), str):
        raise BadRow("non_string_content", f"message {i} ({role}) reasoning_content is not a string")
    return {"role": ROLES[role.lower()], "content": content, **extra}
