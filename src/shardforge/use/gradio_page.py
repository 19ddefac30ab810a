"""`inference --gradio`: a chat page in the browser (Gradio's `ChatInterface`): multi-turn, each
reply streamed as it is generated, the generation settings on the page (under "Generation
settings"), the conversation rendered with the chat template training used.

Local only unless the config says otherwise: bound to 127.0.0.1 (`gradio_server_name`), no
public share link (`gradio_share`, off by default where Axolotl's is on), Gradio's analytics
off, the page in the system's fonts (no font server asked). Gradio is the `ui` extra.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.io.publish import sigterm_as_interrupt
from shardforge.use.chat import SPECS, Settings, stream_reply
from shardforge.use.model import Loaded

log = logging.getLogger("shardforge")

DEFAULT_SERVER_NAME = "127.0.0.1"
# the settings shown on the page, in order, with their slider steps
SLIDERS = (
    ("temperature", 0.05),
    ("top_p", 0.01),
    ("top_k", 1),
    ("max_new_tokens", 1),
    ("repetition_penalty", 0.01),
)


def import_gradio() -> Any:
    """Gradio, with its analytics off (its version check and usage reports stay home); one
    error line naming the extra where it is not installed."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    try:
        import gradio
    except ImportError:
        raise ShardforgeError(
            "inference --gradio needs Gradio, which is not installed: pip install "
            "'shardforge[ui]' (or use --chat, the chat in the terminal)"
        ) from None
    return gradio


def _text(content: Any) -> str:
    """A message's text, from Gradio's history (a string, or parts with text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list | tuple):
        return "".join(_text(part) for part in content)
    return ""


def _messages(message: Any, history: list[Any]) -> list[dict[str, str]]:
    turns = [
        {"role": str(m["role"]), "content": _text(m.get("content"))}
        for m in history
        if isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
    ]
    return [*turns, {"role": "user", "content": _text(message)}]


def build_page(
    loaded: Loaded, cfg: ShardforgeConfig, settings: Settings, title: str, gr: Any
) -> Any:
    """The page (a `gr.ChatInterface`), replying with `loaded` and the settings on the page."""

    def respond(message: Any, history: list[Any], *values: Any) -> Iterator[str]:
        now = Settings(**{**vars(settings)})
        for (name, _), value in zip(SLIDERS, values, strict=True):
            setattr(now, name, int(value) if SPECS[name].cast is int else float(value))
        now.reseed()
        text = ""
        for piece in stream_reply(loaded, cfg, _messages(message, history), now):
            text += piece
            yield text

    sliders = [
        gr.Slider(
            SPECS[name].low,
            min(SPECS[name].high, 4096) if name == "max_new_tokens" else SPECS[name].high,
            value=getattr(settings, name),
            step=step,
            label=name,
            elem_id=f"setting-{name}",
        )
        for name, step in SLIDERS
    ]
    return gr.ChatInterface(
        respond,
        title=title,
        additional_inputs=sliders,
        additional_inputs_accordion=gr.Accordion("Generation settings", open=True),
        chatbot=gr.Chatbot(elem_id="chat", label=title),
        textbox=gr.Textbox(placeholder="Type a message", elem_id="prompt", show_label=False),
        analytics_enabled=False,
        flagging_mode="never",
    )


def serve(loaded: Loaded, cfg: ShardforgeConfig, settings: Settings, model_name: str) -> None:
    """Serve the chat page until interrupted (Ctrl-C, SIGTERM: the server closed, exit 0)."""
    gr = import_gradio()
    title = cfg.gradio_title or f"shardforge: {model_name}"
    page = build_page(loaded, cfg, settings, title, gr)
    host = cfg.gradio_server_name or DEFAULT_SERVER_NAME
    share = bool(cfg.gradio_share)
    if share:
        log.warning("gradio_share: true: Gradio makes a public link to this page (gradio.live)")
    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    theme = gr.themes.Default(font=system, font_mono=["ui-monospace", "monospace"])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own requests to the page
    _, local_url, share_url = page.queue().launch(
        server_name=host,
        server_port=cfg.gradio_server_port,
        share=share,
        inbrowser=False,
        ssr_mode=False,
        theme=theme,
        footer_links=[],
        quiet=True,
        prevent_thread_lock=True,
    )
    log.info("page: %s%s (Ctrl-C stops it)", local_url, f" and {share_url}" if share_url else "")
    try:
        with sigterm_as_interrupt():
            while page.is_running:
                time.sleep(0.2)
    except KeyboardInterrupt:
        log.info("page closed")
    finally:
        page.close()
