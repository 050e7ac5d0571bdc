"""The chat rendering moved below both of its users (the server and `LLM.chat`): it is
`pagedserve.engine.chat_template`. This name stays for imports written before the move."""

from pagedserve.engine.chat_template import (  # noqa: F401 (re-exported)
    GEMMA_END_OF_TURN,
    GEMMA_START_OF_TURN,
    GEMMA_TURN_TEMPLATE,
    PLAIN_TEMPLATE,
    ChatFormat,
    default_chat_format,
    flatten_content,
    render_chat,
)
