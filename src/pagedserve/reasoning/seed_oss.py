"""``seed_oss`` (ByteDance Seed-OSS): ``<seed:think>`` ... ``</seed:think>``, deepseek_r1's
rules."""

from pagedserve.reasoning.base import ReasoningParser


class SeedOssReasoningParser(ReasoningParser):
    name = "seed_oss"
    START = ("<seed:think>",)
    END = ("</seed:think>",)
