"""Settings declared once, TRL's `XConfig` way: each group of the config is a dataclass whose fields carry the
default, the type and the help (`setting`), and whose `__post_init__` checks the values. `register` makes it Hydra's
structured config for its group, so conf/ holds presets only, Hydra refuses an unknown key and a value of the wrong
type while composing, and the stage builds the checked instance from the composed group before anything runs."""
from __future__ import annotations

from dataclasses import MISSING, field, fields, is_dataclass
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.errors import PipelineError


def setting(default, help: str):
    """A field with its default and its help (a list default is stored as a tuple: the instances are frozen)."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def group(cls, help: str):
    """A field holding a sub-group's dataclass at its defaults."""
    return field(default_factory=cls, metadata={"help": help})


def schema(cls):
    """`cls`'s structured config at its defaults, open to overrides and presets."""
    return _writable(OmegaConf.structured(cls))


def _writable(node):
    """A frozen dataclass makes a read-only node; overrides and presets must still merge into the schema."""
    node._set_flag("readonly", None)
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            _writable(child)
    return node


def register(group: str, cls, name: str = "default", package: str | None = None) -> None:
    """`cls` as option `name` of config group `group` (conf/config.yaml's defaults list, or a preset's, picks it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=group, name=name, node=schema(cls), package=package)


def help_lines(cls, prefix: str) -> list[str]:
    """`key (type) = default: help` for every setting of `cls` and its sub-groups."""
    lines = []
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()
        if is_dataclass(default):
            lines += help_lines(type(default), f"{prefix}{f.name}.")
        else:
            lines.append(f"{prefix}{f.name} = {default!r}: {f.metadata.get('help', '')}")
    return lines


def check_keys(values: dict, names: list[str], where: str, declared: str) -> None:
    """One-line errors for keys of `values` (the group at `where`, e.g. calibrate) that `names` does
    not declare, and for declared names the group lacks (a params file is read without the schema)."""
    unknown = [key for key in values if key not in names]
    if unknown:
        raise PipelineError(f"unknown setting(s) {', '.join(f'{where}.{key}' for key in unknown)}: use the keys "
                            f"{declared} declares (check the spelling of the override)")
    missing = [key for key in names if key not in values]
    if missing:
        raise PipelineError(f"setting(s) {', '.join(f'{where}.{key}' for key in missing)} missing from the composed "
                            f"config: {declared} declares them")


def build(cls, values, where: str, declared: str, built: dict | None = None):
    """`cls` from the mapping `values` at `where` (e.g. calibrate.cost), declared in `declared`: every field's key, no
    other, but the fields `built` gives; a dataclass-typed field from its own sub-mapping, a tuple-typed one a tuple
    (the instances are frozen)."""
    if not isinstance(values, dict):
        raise PipelineError(f"{where}={values!r} is not a group of settings: restore it from {declared}")
    built = built or {}
    values = {key: value for key, value in values.items() if key not in built}
    names = [f.name for f in fields(cls) if f.name not in built]
    check_keys(values, names, where, declared)
    types = {name: _settings_type(hint) for name, hint in get_type_hints(cls).items()}

    def value(name: str):
        kind, given = types[name], values[name]
        if is_dataclass(kind):
            return build(kind, given, f"{where}.{name}", declared)
        return tuple(given) if get_origin(kind) is tuple and isinstance(given, list) else given

    return cls(**built, **{name: value(name) for name in names})


def _settings_type(hint):
    """`X | None` -> X, so an optional group of settings is built as its dataclass where it is given."""
    args = [arg for arg in get_args(hint) if arg is not type(None)]
    return args[0] if get_origin(hint) in (Union, UnionType) and len(args) == 1 else hint


def refuse(checks) -> None:
    """The message of the first `(bad, message)` whose `bad` holds, as a one-line error."""
    for bad, message in checks:
        if bad:
            raise PipelineError(message)
