"""``deepseek_v31`` (DeepSeek V3.1): content, then ``<｜tool▁calls▁begin｜>``, each call
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """The arguments unfenced, no call type."""

    name = "deepseek_v31"
    BEGIN = "<｜tool▁calls▁begin｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)"
                      r"(?:<｜tool▁call▁end｜>|<｜tool▁calls▁end｜>|$)", re.DOTALL)
