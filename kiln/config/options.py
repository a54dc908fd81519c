"""The flat options (`LLM(max_model_len=...)`, `--max-model-len`, a profile's `[serve]` keys),
derived from the fields of the config dataclasses that carry an `option`: one list, so the
Python API, the command line and the launcher profiles cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kiln.config.compilation import CompilationConfig
from kiln.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from kiln.config.server import ServerConfig


@dataclass(frozen=True)
class Option:
    name: str  # the keyword, profile key and argparse destination
    section: str  # which config holds it: "cache", "scheduler", "engine" or "server"
    field: str  # its field there
    kind: type | tuple[type, ...]  # what a profile or the command line gives
    help: str
    negatable: bool = False
    profile: bool = True  # whether a launcher profile may set it
    choices: tuple[str, ...] | None = None
    flags: tuple[str, ...] = ()  # the command-line spellings; default --name-with-dashes

    @property
    def cli_flags(self) -> tuple[str, ...]:
        return self.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def is_bool(self) -> bool:
        return self.kind is bool


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "engine": EngineConfig}


def _options(section: str, cls: type) -> list[Option]:
    options = []
    for f in fields(cls):
        meta = dict(f.metadata.get("option", {}))
        if meta:
            name = meta.pop("name", f.name)
            options.append(Option(name, section, f.name, **meta))
    return options


def engine_options() -> list[Option]:
    return [o for section, cls in _SECTIONS.items() for o in _options(section, cls)]


def server_options() -> list[Option]:
    return _options("server", ServerConfig)


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from vLLM-style flat keyword arguments; None means the default."""
    options = {o.name: o for o in engine_options()}
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise TypeError(f"unknown engine options {unknown}; known: {sorted(options)}")
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for name, value in kwargs.items():
        if value is not None:
            sections[options[name].section][options[name].field] = value
    engine = sections["engine"]
    compilation = engine.get("compilation")
    if not isinstance(compilation, CompilationConfig):
        engine["compilation"] = CompilationConfig.from_json(compilation)
    return EngineConfig(
        model=model,
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
        **engine,
    )
