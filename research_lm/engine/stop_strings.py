"""Stop strings (`SamplingParams.stop`): end a request when its output text contains one, as vLLM does.

The check runs in the scheduler after every emitted token, like the stop-token check, so a verify step that
emits several tokens stops at the same token as plain decoding would (vLLM checks once per step instead).
A token can only complete a stop string that ends in the characters it added, so each check decodes a short
window of the last tokens, twice (with and without the new one), never the whole output. The window holds
`len(longest stop string) + _SLACK` tokens: every token but a few (a special token skipped, a byte of an
unfinished character) adds at least one character.

Text semantics follow vLLM: the output text is cut before the stop string (`include_stop_str_in_output`
keeps it), the token ids keep every token up to the one that completed it, `stop_reason` is the string, and
a stop string is looked for only in text that tokens after the first `min_tokens` added.
"""

from __future__ import annotations

import os
from typing import Any

from research_lm.engine.request import Request

_SLACK = 8  # extra window tokens for tokens that add no character


class StopStrings:
    """Checks a request's stop strings with the engine's tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def check(self, request: Request, num_output: int) -> str | None:
        """The stop string that output token number `num_output` (1-based, already in `output_token_ids`)
        completed, if any; then `request.output_text` is set to the output text cut at it."""
        params = request.sampling_params
        if not params.stop or num_output <= params.min_tokens:
            return None
        ids = request.output_token_ids
        skip = params.skip_special_tokens
        start = max(0, num_output - max(map(len, params.stop)) - _SLACK)
        before = self.tokenizer.decode(ids[start : num_output - 1], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[start:num_output], skip_special_tokens=skip)
        new = len(os.path.commonprefix([before, after]))  # `after` from here on is this token's text
        found = [(i, s) for s in params.stop if (i := after.find(s, max(0, new - len(s) + 1))) >= 0]
        if not found:
            return None
        at, stop = min(found)  # the earliest in the text; the first listed on a tie
        # Cut the whole output text: the window's text is its suffix (a window's first token may decode without
        # the leading space it has in context, but that changes only the window's start, never its end).
        text = self.tokenizer.decode(ids[:num_output], skip_special_tokens=skip)
        cut = len(text) - (len(after) - at) + (len(stop) if params.include_stop_str_in_output else 0)
        request.output_text = text[:cut]
        return stop
