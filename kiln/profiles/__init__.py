"""Launcher profiles: TOML files that fix every serving parameter of a configuration, so two
benchmark rows differ in exactly the settings their profiles differ in.

A profile names a model (`"default"` is the embedded GGUF, `"default-hf"` the same model as a
bf16 HF directory in kiln's cache), a `[serve]` table with `kiln serve`'s option names, and the
`[[probes]]` that model is known to answer. A profile whose `engine` is `"external"` launches
another server (llama.cpp, vLLM) from its `command` instead, with `python` naming the
interpreter its {python} stands for when that is not kiln's.
Shipped profiles live beside this file; `kiln serve --profile NAME` and `kiln bench` accept
either a shipped name or a path to a .toml file."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from kiln.config.compilation import CompilationConfig
from kiln.config.options import engine_options, server_options
from kiln.config.speculative import SpeculativeConfig
from kiln.default_model import EMBEDDED_HF, default_model_path, embedded_hf_dir
from kiln.errors import ConfigError, KilnError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PROFILE_DIR = os.path.dirname(os.path.abspath(__file__))


def serve_keys() -> dict[str, type | tuple[type, ...]]:
    """The `kiln serve` options a profile may set (the engine's and the server's, less the
    port and the API key), with the type each takes."""
    return {o.name: o.kind for o in [*engine_options(), *server_options()] if o.profile}


@dataclass(frozen=True)
class Probe:
    prompt: str
    expect: str  # the answer must contain this (case-insensitive)
    max_tokens: int = 24


@dataclass(frozen=True)
class Profile:
    name: str
    path: str
    description: str = ""
    model: str | None = None  # None: the embedded model
    engine: str = "kiln"  # or "external"
    serve: dict[str, Any] = field(default_factory=dict)
    command: tuple[str, ...] = ()  # external engines: argv with {model} {port} {python}
    # external engines: the interpreter {python} names ($VARS, ${VAR:-default}, ~ expanded when
    # the command is filled); None: kiln's own
    python: str | None = None
    # the GGUF that `model` (an HF directory in kiln's cache) is exported from before a launch
    export_from: str | None = None
    probes: tuple[Probe, ...] = ()
    # random weights answer noise: the bench skips its checks of the answers' text for it
    random_weights: bool = False

    def serve_defaults(self) -> dict[str, Any]:
        """The [serve] table as argparse destinations (the JSON options as JSON)."""
        out = dict(self.serve)
        for name in ("compilation_config", "speculative_config"):
            if name in out:
                out[name] = json.dumps(out[name])
        return out

    def with_serve(self, name: str, **overrides: Any) -> Profile:
        serve = _check_serve({**self.serve, **overrides}, self.path)
        return dataclasses.replace(self, name=name, serve=serve)


def shipped_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".toml"))


def profile_path(name_or_path: str) -> str:
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not os.path.isfile(name_or_path):
            raise ConfigError(f"profile file {name_or_path!r} does not exist")
        return name_or_path
    path = os.path.join(PROFILE_DIR, name_or_path + ".toml")
    if not os.path.isfile(path):
        raise ConfigError(
            f"unknown profile {name_or_path!r}: shipped profiles are "
            f"{', '.join(shipped_profiles())}, or pass a path to a .toml file"
        )
    return path


def load_profile(name_or_path: str) -> Profile:
    path = profile_path(name_or_path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path} is not valid TOML: {exc}") from None
    return _profile_from_dict(data, path)


def _profile_from_dict(data: dict[str, Any], path: str) -> Profile:
    known = {"name", "description", "model", "engine", "serve", "command", "probes",
             "random_weights", "python"}  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"profile {path}: unknown keys {unknown}; known: {sorted(known)}")
    engine = data.get("engine", "kiln")
    if engine not in ("kiln", "external"):
        raise ConfigError(f"profile {path}: engine must be 'kiln' or 'external', got {engine!r}")
    command = tuple(str(a) for a in data.get("command", ()))
    if engine == "external" and not command:
        raise ConfigError(f"profile {path}: an external engine needs a `command` list")
    model = data.get("model", "default")
    python = data.get("python")
    if python is not None and (engine != "external" or not isinstance(python, str)):
        raise ConfigError(f"profile {path}: python is a path string, for external engines only")
    export_from = default_model_path() if model == EMBEDDED_HF else None
    return Profile(
        name=str(data.get("name") or os.path.basename(path)[:-5]),
        path=os.path.abspath(path),
        description=str(data.get("description", "")),
        model=_model_path(str(model)),
        engine=engine,
        serve=_check_serve(data.get("serve", {}), path) if engine == "kiln" else {},
        command=command,
        probes=tuple(_probe(p, path) for p in data.get("probes", ())),
        random_weights=_flag(data, "random_weights", path),
        python=python,
        export_from=export_from,
    )


def _model_path(model: str) -> str | None:
    """None for the embedded GGUF; "default-hf" is where its HF export lives (written by the
    bench before a launch, or by `kiln export-hf`), a cheap path that loading does not write."""
    if model == "default":
        return None
    return embedded_hf_dir() if model == EMBEDDED_HF else model


def _flag(data: dict[str, Any], key: str, path: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"profile {path}: {key} must be true or false, got {value!r}")
    return value


def _check_serve(serve: dict[str, Any], path: str) -> dict[str, Any]:
    keys = serve_keys()
    for key, value in serve.items():
        if key not in keys:
            raise ConfigError(
                f"profile {path}: [serve] has unknown option {key!r}; known: {sorted(keys)}"
            )
        kinds = keys[key] if isinstance(keys[key], tuple) else (keys[key],)
        ok = any(_is_a(value, kind) for kind in kinds)
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"profile {path}: [serve] {key} must be {names}, got {value!r}")
    if "compilation_config" in serve:  # checked now, not when a server boots on it
        try:
            CompilationConfig.from_json(serve["compilation_config"])
        except KilnError as exc:
            raise ConfigError(f"profile {path}: [serve] compilation_config: {exc}") from None
    if "speculative_config" in serve:
        try:
            SpeculativeConfig.from_json(serve["speculative_config"])
        except KilnError as exc:
            raise ConfigError(f"profile {path}: [serve] speculative_config: {exc}") from None
    return dict(serve)


def _is_a(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _probe(raw: dict[str, Any], path: str) -> Probe:
    if not isinstance(raw, dict) or "prompt" not in raw or "expect" not in raw:
        raise ConfigError(f"profile {path}: each [[probes]] needs `prompt` and `expect`")
    return Probe(str(raw["prompt"]), str(raw["expect"]), int(raw.get("max_tokens", 24)))
