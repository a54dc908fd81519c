"""vLLM's way of passing a JSON argument's fields as flags of their own, so launchers carry
over: `-O.mode=3`, `--compilation-config.cudagraph_mode FULL`, and list items with `+`:
`-O.cudagraph_capture_sizes+ 1 -O.cudagraph_capture_sizes+=2,4`. Each value is read as JSON
where it parses (`3`, `true`, `[1, 2]`) and as a string otherwise (`FULL`).

They are taken out of argv before argparse sees it (argparse would read `-O.mode=3` as `-O`
with the value `.mode=3`) and merged over the JSON value of `--compilation-config`, if any."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.config.compilation import compilation_data
from kiln.errors import ConfigError

PREFIXES = ("--compilation-config.", "-O.")


@dataclass(frozen=True)
class DottedField:
    flag: str  # as written, for error messages
    path: tuple[str, ...]  # "a.b" -> ("a", "b")
    values: tuple[Any, ...]
    append: bool  # `key+`: items added to a list


def split_dotted(argv: list[str]) -> tuple[list[str], list[DottedField]]:
    """argv without the dotted compilation flags, and those flags parsed."""
    rest: list[str] = []
    dotted: list[DottedField] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        prefix = next((p for p in PREFIXES if arg.startswith(p)), None)
        if prefix is None:
            rest.append(arg)
            i += 1
            continue
        key, has_value, value = arg[len(prefix) :].partition("=")
        if not has_value:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{arg} needs a value, e.g. {prefix}mode=3")
            value = argv[i + 1]
        dotted.append(_parse_field(arg, key, value))
        i += 1 if has_value else 2
    return rest, dotted


def _parse_field(flag: str, key: str, value: str) -> DottedField:
    append = key.endswith("+")
    key = key.removesuffix("+")
    path = tuple(key.split("."))
    if not all(path):
        raise ConfigError(f"{flag}: name a field after the dot, e.g. -O.mode=3")
    items = value.split(",") if append else [value]
    return DottedField(flag, path, tuple(_json_or_text(v) for v in items), append)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def merge_dotted(base: str | None, dotted: list[DottedField]) -> str | None:
    """The JSON for `--compilation-config`: `base` (a JSON value, or None) with the fields
    set or extended."""
    if not dotted:
        return base
    data = compilation_data(base) if base is not None else {}
    for field in dotted:
        _apply(data, field)
    return json.dumps(data)


def _apply(data: dict[str, Any], field: DottedField) -> None:
    *parents, name = field.path
    for parent in parents:
        data = data.setdefault(parent, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{field.flag}: {parent} is not an object")
    if not field.append:
        data[name] = field.values[0]
        return
    items = data.setdefault(name, [])
    if not isinstance(items, list):
        raise ConfigError(f"{field.flag}: {name} is {items!r}, not a list to add items to")
    items.extend(field.values)
