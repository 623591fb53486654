"""A chat turn's prompt is tokenized in the parts it shares with earlier turns only once.

A full-history client (an OpenAI-style agent) sends its whole conversation every turn; SGLang
renders it with the chat template and encodes all of it again: 35 ms for a 16k-token history on a
2-core Xeon, every turn, growing with the history. SGLang already has what makes this incremental,
for renderers that hand over their prompt in segments: `encode_prompt_segments` encodes the text
between cut tokens (added tokens that the tokenizer matches wherever they stand) once and keeps it
in a bounded per-tokenizer cache, with ids equal to encoding the whole text (its contract; it falls
back to the whole encode for every tokenizer where that argument does not hold). The Jinja path
renders one string, so this AROUND hook on serving_chat's `parallel_prompt_encode` cuts the string
at the tokenizer's added tokens and hands the pieces to it: each earlier message is then a cache
hit, and a turn encodes its new messages only.
"""

from __future__ import annotations

import re
import threading
import weakref

from sglang.srt.entrypoints.openai.parallel_prompt_encode import encode_prompt_segments

_patterns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# encode_prompt_segments falls back to parallel_prompt_encode, which is this hook once patched
_inside = threading.local()


def _added_tokens(tokenizer) -> re.Pattern | None:
    """The tokenizer's added tokens as one alternation, longest first (None: it has none). Where a
    piece of text is not a token the tokenizer cuts at, encode_prompt_segments joins it to its
    neighbours again, so this only decides where the cache's pieces can end."""
    try:
        return _patterns[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: left to SGLang's own encode
        return None
    contents = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content}, key=len, reverse=True)
    pattern = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
    _patterns[tokenizer] = pattern
    return pattern


def encode_hook(original, tokenizer, text, encode_kwargs=None):
    """AROUND hook on serving_chat.parallel_prompt_encode (patches/hooks.yaml): the same ids,
    earlier turns' text encoded once."""
    pattern = _added_tokens(tokenizer) if isinstance(text, str) and not getattr(_inside, "active", False) else None
    if pattern is None:
        return original(tokenizer, text, encode_kwargs)
    _inside.active = True
    try:
        return encode_prompt_segments(tokenizer, pattern.split(text), encode_kwargs)
    finally:
        _inside.active = False
