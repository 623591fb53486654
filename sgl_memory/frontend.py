"""SGLang frontend programs (`sgl.function`) with a session: a RuntimeEndpoint that sends the
`sgl_memory` field.

The frontend's sampling arguments have no place for it, so the endpoint takes it from the program's
own arguments named after the field's keys (`session_id`, `tenant`, `readonly` and every registered
mechanism's: the pruning keys `budget`, `scorer`, ..., `memory`, `keep`), on every call the program makes:

    @sgl.function
    def ask(s, question, session_id, memory=None):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    sgl.set_default_backend(MemoryEndpoint("http://localhost:30000"))
    ask.run(question="What is my cat called?", session_id="agent-1", memory={"mode": "retrieve"})
"""

from __future__ import annotations

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_memory.core.request import FIELD, keys


class MemoryEndpoint(RuntimeEndpoint):
    """A RuntimeEndpoint (the backend of SGLang's frontend programs) that adds the `sgl_memory`
    field, from the program's arguments named after its keys, to every request body it sends."""

    def _add_images(self, s, data):
        # the one method every generate, stream and select request body passes through before it is sent
        super()._add_images(s, data)
        field = {name: s.arguments[name] for name in keys() if s.arguments.get(name) is not None}
        if field:
            data[FIELD] = field
