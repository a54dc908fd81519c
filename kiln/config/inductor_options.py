"""`inductor_compile_config`: Inductor's own option names (torch._inductor.config), checked
against this torch, and rendered for the compile cache key.

An option's value is part of that key, so it must say what it is in every process. JSON values
do. A Python object given through the API (a custom graph pass for `post_grad_custom_post_pass`)
would print as `<function at 0x7f...>`, a key that changes every boot: kiln takes only objects
that name their own version, torch's `CustomGraphPass` with its `uuid()`, which Inductor's own
cache requires of a pass as well."""

from __future__ import annotations

import difflib
from typing import Any

from kiln.errors import ConfigError

_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLAIN = (type(None), bool, int, float, str)


def parse_inductor_config(options: Any) -> tuple[tuple[str, Any], ...]:
    """The options as sorted (name, value) pairs; a misspelt option would change nothing, so
    every name is checked, and every value against the option's type."""
    if isinstance(options, tuple):  # already parsed (dataclasses.replace)
        options = dict(options)
    if not isinstance(options, dict):
        raise ConfigError(
            "inductor_compile_config must be an object of Inductor options, e.g. "
            f'{{"max_autotune": true}}, got {options!r}'
        )
    import torch
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    options = dict(_flatten(options, known))
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"inductor_compile_config: {name!r} is not an option of torch {torch.__version__}"
                f"'s Inductor (torch._inductor.config){hint}"
            )
        _check_option_type(name, value, known[name])
        option_key_value(name, value)  # refuses a value the cache key cannot name
    return tuple(sorted(options.items()))


def shown_options(options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Parsed options as the compile cache key, `kiln info` and `/v1/engine` show them."""
    return {name: option_key_value(name, value) for name, value in options}


def option_key_value(name: str, value: Any) -> Any:
    """`value` as the compile cache key and `/v1/engine` show it: JSON values as they are, a
    graph pass as its class and uuid."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [option_key_value(name, v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: option_key_value(name, v) for k, v in value.items()}
    uuid = getattr(value, "uuid", None)
    keyable = callable(uuid) and not isinstance(value, type)
    version = _call_uuid(name, value, uuid) if keyable else None
    if version is None:
        raise ConfigError(
            f"inductor_compile_config: {name} is {_what(value)}"
            f"{', whose uuid() returned None' if keyable else ''}, which the compile cache key "
            "cannot name: its key would differ in every process, and a changed pass could load "
            "another's compiled code. Remedy: make it a torch._inductor.custom_graph_pass."
            "CustomGraphPass whose uuid() changes with its code (e.g. returns "
            "torch._inductor.custom_graph_pass.get_hash_for_files((__file__,)))"
        )
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}(uuid={version!r})"


def _call_uuid(name: str, value: Any, uuid: Any) -> Any:
    try:
        return uuid()
    except Exception as exc:  # the user's code: say whose and what
        raise ConfigError(
            f"inductor_compile_config: {name}: {_what(value)}'s uuid() raised "
            f"{type(exc).__name__}: {exc}"
        ) from None


def _what(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__qualname__} (an instance of it is what Inductor calls)"
    label = getattr(value, "__qualname__", None)
    if label:
        return f"{type(value).__name__} {getattr(value, '__module__', '?')}.{label}"
    return f"a value of type {type(value).__qualname__}"


def _flatten(options: dict[str, Any], known: dict[str, Any], prefix: str = ""):
    """{"cpp": {"simdlen": 8}} (what `-O.inductor_compile_config.cpp.simdlen=8` gives) is
    Inductor's "cpp.simdlen"; an option whose value is a dict stays one option."""
    for key, value in options.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in known:
            yield from _flatten(value, known, f"{name}.")
        else:
            yield name, value


def _check_option_type(name: str, value: Any, default: Any) -> None:
    for kind, kind_name in _KIND_NAMES.items():  # bool first: it is an int too
        if isinstance(default, kind):
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if kind is float:
                ok = ok or (isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise ConfigError(
                    f"inductor_compile_config: {name} takes {kind_name} (its default is "
                    f"{default!r}), got {value!r}"
                )
            return
