"""vLLM 0.32's `vllm serve` flags, every one, and how `pagedserve serve` handles each: the table.

Each vLLM flag is handled one of three ways, never with argparse's "unrecognized arguments":

- supported: a flag of ours with vLLM's meaning (`EngineArgs`' fields, `entrypoints/cli.py`'s
  and `entrypoints/openai/cli_args.py`'s server flags);
- ignored: accepted, and one INFO line at start says it has no effect here and why (as vLLM does
  for GPU-only knobs on CPU);
- refused: an error at start naming the flag and what is missing;
- "only V,...": accepted when its value is what pagedserve does anyway, refused otherwise.

`add_vllm_flags` gives the parser a placeholder for every ignored or refused flag that it does
not already have (with vLLM's argument shape), `check_vllm_flags` acts on those given, and
`GroupedParser` files each flag under vLLM's help group (`serve --help=GROUP`). The table's rows
(entrypoints/vllm_flag_table.py) are vLLM 0.32's `serve --help=all` (tests/entrypoints/test_vllm_flags.py checks that every one of
them is here, and that each "supported" flag is one of ours).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.vllm_flag_table import _TABLE, REASONS  # (the data)

logger = logging.getLogger("pagedserve.flags")

SUPPORTED, IGNORED, REFUSED = "supported", "ignored", "refused"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: its help group, spellings (the first is its name), argument shape (flag:
    no value; bool: --x / --no-x; value; list: one or more values; optional: zero or one value;
    append: repeatable; help), how pagedserve handles it, the values it accepts (`only`) and why
    it is ignored or refused."""

    group: str
    flags: tuple[str, ...]
    shape: str
    how: str
    only: tuple[str, ...] = ()
    reason: str = ""

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def dest(self) -> str:
        """The placeholder's attribute (apart from every real option's)."""
        return "vllm_" + self.name.lstrip("-").replace("-", "_")


def _parse_table(text: str) -> dict[str, VllmFlag]:
    table = {}
    for line in text.strip().splitlines():
        group, flags, shape, how, *rest = [c.strip() for c in line.split("|")]
        key = rest[0] if rest else ""
        only: tuple[str, ...] = ()
        if how.startswith("only"):
            only = tuple(how[len("only"):].strip().split(",")) if how != "only" else ("",)
            how = "only"
        if how not in (SUPPORTED, IGNORED, REFUSED, "only"):
            raise ValueError(f"vllm_flags: bad handling {how!r} for {flags}")
        if key and key not in REASONS:
            raise ValueError(f"vllm_flags: no reason {key!r} for {flags}")
        flag = VllmFlag(group, tuple(flags.split()), shape, how, only, REASONS.get(key, ""))
        table[flag.name] = flag
    return table


VLLM_FLAGS: dict[str, VllmFlag] = _parse_table(_TABLE)
"""vLLM 0.32's serve flags by name (their first spelling)."""

VLLM_GROUPS: tuple[str, ...] = tuple(dict.fromkeys(f.group for f in VLLM_FLAGS.values()))
OURS = "pagedserve"
"""The help group of pagedserve's own flags (those vLLM does not have)."""

_BY_SPELLING = {s: f for f in VLLM_FLAGS.values() for s in f.flags}


class GroupedParser:
    """An `argparse.ArgumentParser` stand-in whose `add_argument` files each flag under vLLM's
    help group for it (pagedserve's own flags under "pagedserve"): pass it where a parser is
    expected (`EngineArgs.add_cli_args`, `add_serve_args`)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.groups: dict[str, Any] = {}

    def group(self, title: str):
        if title not in self.groups:
            self.groups[title] = self.parser.add_argument_group(title)
        return self.groups[title]

    def add_argument(self, *flags: str, **kwargs: Any):
        found = next((_BY_SPELLING[f] for f in flags if f in _BY_SPELLING), None)
        if found is None and flags and not flags[0].startswith("-"):
            return self.parser.add_argument(*flags, **kwargs)  # positionals stay where they are
        return self.group(found.group if found else OURS).add_argument(*flags, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def _help(flag: VllmFlag) -> str:
    if flag.how == IGNORED:
        text = f"vLLM's; accepted, no effect here: {flag.reason}"
    elif flag.how == "only":
        text = f"vLLM's; only {' or '.join(repr(v) for v in flag.only)} here: {flag.reason}"
    else:
        text = f"vLLM's; refused here: {flag.reason}"
    return text.replace("%", "%%")


def add_vllm_flags(parser: GroupedParser | argparse.ArgumentParser) -> None:
    """A placeholder argument for every vLLM flag the parser does not have yet (its shape, its
    help saying what pagedserve does with it), absent from the namespace unless given."""
    target = parser.parser if isinstance(parser, GroupedParser) else parser
    taken = set(target._option_string_actions)
    grouped = parser if isinstance(parser, GroupedParser) else GroupedParser(parser)
    for flag in VLLM_FLAGS.values():
        spellings = [s for s in flag.flags if s not in taken]
        if len(spellings) < len(flag.flags) or flag.how == SUPPORTED:
            # ours (some spelling is a real option), or supported by a flag of ours elsewhere
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS,
                                  "help": _help(flag)}
        if flag.shape not in ("flag", "bool"):
            kwargs["metavar"] = flag.name.lstrip("-").upper().replace("-", "_")
        if flag.shape == "flag":
            kwargs["action"] = "store_true"
        elif flag.shape == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.shape == "list":
            kwargs["nargs"] = "+"
        elif flag.shape == "optional":
            kwargs.update(nargs="?", const=True)
        elif flag.shape == "append":
            kwargs["action"] = "append"
        grouped.group(flag.group).add_argument(*spellings, **kwargs)


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Act on the placeholders given: one INFO line each for the ignored ones; ValueError naming
    the first refused one and what is missing (or a value an "only" flag does not take)."""
    for flag in VLLM_FLAGS.values():
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if flag.how == IGNORED:
            logger.info("%s has no effect here: %s", flag.name, flag.reason)
        elif flag.how == "only":
            values = value if isinstance(value, list) else [value]
            bad = [v for v in values if str(v) not in flag.only]
            if bad:
                raise ValueError(f"{flag.name} {bad[0]!s}: not supported here ({flag.reason}); "
                                 f"accepted: {', '.join(repr(v) for v in flag.only)}")
        else:
            raise ValueError(f"{flag.name} is not supported here: {flag.reason}")


def help_topic(argv: list[str]) -> str | None:
    """The topic of a `--help=TOPIC` in argv (vLLM's: all, a group, or part of a flag name)."""
    for arg in argv:
        if arg.startswith("--help="):
            return arg.split("=", 1)[1]
    return None


def format_help(parser: argparse.ArgumentParser, topic: str) -> str:
    """`serve --help=TOPIC`, as vLLM's: `all` every group; a group's name (case-insensitive) that
    group; otherwise every flag whose name contains TOPIC. ValueError when nothing matches."""
    groups = [g for g in parser._action_groups if g._group_actions]
    if topic.lower() == "all":
        return parser.format_help()
    chosen = [g for g in groups if (g.title or "").lower() == topic.lower()]
    if chosen:
        return _format_groups(parser, chosen)
    needle = topic.lower().lstrip("-").replace("_", "-")
    actions = [a for g in groups for a in g._group_actions
               if any(needle in s.lstrip("-") for s in a.option_strings)]
    if not actions:
        titles = ", ".join(g.title for g in groups if g.title)
        raise ValueError(f"--help={topic}: no such group or flag (groups: {titles}; or all)")
    formatter = parser._get_formatter()
    formatter.start_section(f"flags matching {topic!r}")
    formatter.add_arguments(actions)
    formatter.end_section()
    return formatter.format_help()


def _format_groups(parser: argparse.ArgumentParser, groups: list) -> str:
    formatter = parser._get_formatter()
    for group in groups:
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
    return formatter.format_help()


def config_file_args(argv: list[str]) -> list[str]:
    """argv with `--config FILE` (vLLM's: a YAML mapping of flag names to values) replaced by
    the flags it holds, placed before the command line's own so that those win, as in vLLM.
    `model:` becomes the positional model unless the command line names one. ValueError for a
    file that cannot be read or is not such a mapping."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            del argv[i:i + (1 if "=" in arg else 2)]
            break
    if not path:
        raise ValueError("--config needs a YAML file")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    extra: list[str] = []
    model = data.pop("model", None)
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                extra.append(flag)
            elif _BY_SPELLING.get(flag, VllmFlag("", (), "", "")).shape == "bool" or \
                    flag.startswith("--enable-"):
                extra.append("--no-" + flag[2:])
        elif isinstance(value, list):
            extra += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            extra += [flag, json.dumps(value)]
        elif value is not None:
            extra += [flag, str(value)]
    # after the subcommand and any positional model of the command line
    start = argv.index("serve") + 1 if "serve" in argv else 0
    positional = start < len(argv) and not argv[start].startswith("-")
    if model is not None and not positional:
        argv.insert(start, str(model))
        positional = True
    at = start + (1 if positional else 0)
    return argv[:at] + extra + argv[at:]


def print_help_topic(parser: argparse.ArgumentParser, topic: str) -> None:
    sys.stdout.write(format_help(parser, topic))
