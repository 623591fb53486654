"""What a user sees when the server starts: one line that says what is served, once it is, and no
traceback on a normal start.

SGLang's warm-up thread posts `/freeze_gc` to the server when its warm-up is done. Under
`--skip-server-warmup` (the launcher's CPU default: a warm-up request costs a CPU server most of a
minute) the thread runs it at once, before the HTTP server listens, and the refused connection
logged a 60-line traceback on every start. The hook waits for the server to answer first, as
SGLang's own warm-up does, then prints the banner and lets the freeze go ahead.

SGLang's model registry imports every model file it ships and logs each one that needs a library
this machine lacks ("Ignore import error when loading sglang.srt.models..."): none of them is the
model being served (one that were would fail to load, loudly). `quiet_import_errors` moves those
lines to debug, in every process (the plugin calls it first).
"""

from __future__ import annotations

import logging
import os
import time

import requests

from sgl_memory import cpu_dtype
from sgl_memory.core import mechanism
from sgl_memory.core.config import CONFIG_ENV, PLAIN_ENV, from_env

logger = logging.getLogger("sgl_memory")

READY_TIMEOUT_S = 120.0  # as SGLang's warm-up waits for the server
IMPORT_ERROR_LOGGERS = (
    "sglang.srt.models.registry",
    "sglang.srt.managers.multimodal_processor",
    "sglang.srt.dllm.algorithm",
)
IMPORT_ERROR = "Ignore import error when loading"


class _ImportErrorsToDebug(logging.Filter):
    """Moves SGLang's "Ignore import error when loading" warnings to debug (`quiet_import_errors`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith(IMPORT_ERROR):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_import_errors() -> None:
    """Idempotent: one filter per logger, whatever the number of calls."""
    for name in IMPORT_ERROR_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _ImportErrorsToDebug) for f in log.filters):
            log.addFilter(_ImportErrorsToDebug())


def banner(server_args) -> str:
    """One line: the model, its dtype, the mechanisms on (and where that choice came from), what
    each mechanism says of itself there (Mechanism.banner: the session store) and the URL."""
    config = from_env()
    on = [name for name, section in config.sections.items() if getattr(section, "enabled", False)]
    choice = cpu_dtype.announced()
    dtype = choice.dtype if choice is not None else server_args.dtype
    notes = "".join(f"; {note}" for cls in mechanism.ordered() if (note := cls.banner(config.section(cls.name))))
    mechanisms = ", ".join(on) if on else "none (plain SGLang behaviour)"
    if os.environ.get(PLAIN_ENV):
        mechanisms += " (--plain)"
    elif not os.environ.get(CONFIG_ENV):
        mechanisms += " (the default; --plain serves without)"
    name = server_args.served_model_name or server_args.model_path
    return f"sgl-memory: serving {name} ({dtype}) at {server_args.url()}; mechanisms: {mechanisms}{notes}"


def _wait_until_up(server_args) -> bool:
    from sglang.srt.arg_groups.serving_hook import ssl_verify_of
    from sglang.srt.runtime_context import get_serving

    headers = {"Authorization": f"Bearer {get_serving().api_key}"} if get_serving().api_key else {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if requests.get(
                server_args.url() + "/model_info", timeout=5, headers=headers, verify=ssl_verify_of(server_args)
            ).ok:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.2)
    return False


def ready_hook(original, server_args, *args, **kwargs):
    """AROUND hook on `http_server._freeze_gc_after_server_warmup` (patches/hooks.yaml): runs in
    SGLang's warm-up thread once the warm-up is done or skipped."""
    if _wait_until_up(server_args):
        logger.info(banner(server_args))
    return original(server_args, *args, **kwargs)
