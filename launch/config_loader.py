"""Strict loading of a frozen-dataclass config tree from YAML files and dotted overrides.

The tree is plain frozen dataclasses; this module knows nothing about Cadence's keys. It turns
`{"learner": {"optimizer": {"lr": 1e-3}}}` and `learner.optimizer.lr=1e-3` into a new tree,
checking every key and value on the way: an unknown key, a wrong type or a value a section's
`validate()` refuses raises ConfigError naming the dotted key (the CLI turns that into exit 2).
A root class may declare `MOVED_KEYS = {"old.key": ("new.key", "why")}`: a config that still uses
an old key is read as if it used the new one, with a FutureWarning saying so.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
import warnings
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key, type or value is wrong; the message names the dotted key."""


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a dataclass tree, e.g. 'learner.optimizer.lr'."""
    keys = []
    for name, hint in _hints(cls).items():
        if name not in _fields(cls):
            continue
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            keys.extend(all_keys(hint, key + "."))
        else:
            keys.append(key)
    return keys


def _unknown(key: str, root_cls) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(root_cls), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def coerce(key: str, hint, value: Any) -> Any:
    """Check `value` against the field type `hint`; return it in that type or raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, arg, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if isinstance(value, bool) and value not in choices:
            # YAML 1.1 reads yes/no/on/off as booleans: `run.resume=no` means the choice "no".
            words = ("yes", "true", "on") if value else ("no", "false", "off")
            value = next((c for c in choices if isinstance(c, str) and c.lower() in words), value)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not {_type_name(hint)}")
        return value
    if origin in (dict, collections.abc.Mapping):
        # A free-form mapping (a plug-in task's args): string keys, YAML values; its owner checks them.
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (e.g. {key}.NAME=VALUE or {key}={{NAME: VALUE}}), "
                              f"got {value!r}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{key}: keys must be strings, got {bad[0]!r}")
        return dict(value)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if hint is Any:
        return value
    raise ConfigError(f"{key}: unsupported field type {hint!r}")


def merge(node, data: dict, root_cls=None, prefix: str = ""):
    """Return a copy of dataclass `node` with the nested dict `data` applied, strictly."""
    root_cls = root_cls or type(node)
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    if not prefix:
        data = move_keys(data, getattr(root_cls, "MOVED_KEYS", {}))
    hints = _hints(type(node))
    fields = _fields(type(node))
    changes = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            while isinstance(value, dict) and len(value) == 1:  # name the whole key the user wrote
                (sub, value), = value.items()
                key = f"{key}.{sub}"
            raise _unknown(key, root_cls)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            changes[name] = merge(getattr(node, name), value, root_cls, key + ".")
        elif typing.get_origin(hint) in (dict, collections.abc.Mapping) and isinstance(value, dict):
            # Mappings merge key by key, so a file's task.args and a task.args.x=1 override combine.
            changes[name] = {**getattr(node, name), **coerce(key, hint, value)}
        else:
            changes[name] = coerce(key, hint, value)
    return dataclasses.replace(node, **changes)


def move_keys(data: dict, moved: dict[str, tuple[str, str]]) -> dict:
    """`data` (a nested dict, not changed) with each old dotted key of `moved` put under its new
    key, warning (FutureWarning) for each; ConfigError when `data` sets both, to different values."""
    for old, (new, why) in moved.items():
        path = old.split(".")
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] not in node:
            continue
        value = node[path[-1]]
        data = _without(data, path)
        have = data
        for part in new.split("."):
            have = have.get(part, _MISSING) if isinstance(have, dict) else _MISSING
        if have is not _MISSING and have != value:
            raise ConfigError(f"{old}: replaced by {new} ({why}); this config sets both, to {value!r} and "
                              f"{have!r}: keep {new} only")
        warnings.warn(f"config key {old} is deprecated: set {new} instead ({why}); read as {new}={value!r}",
                      FutureWarning, stacklevel=2)
        data = _with(data, new.split("."), value)
    return data


_MISSING = object()


def _without(data: dict, path: list[str]) -> dict:
    """A copy of nested `data` without the leaf at `path` (mappings left empty are dropped)."""
    out = dict(data)
    if len(path) == 1:
        out.pop(path[0], None)
        return out
    inner = _without(out[path[0]], path[1:])
    if inner:
        out[path[0]] = inner
    else:
        out.pop(path[0])
    return out


def _with(data: dict, path: list[str], value) -> dict:
    """A copy of nested `data` with `value` at `path`."""
    out = dict(data)
    out[path[0]] = value if len(path) == 1 else _with(out.get(path[0]) if isinstance(out.get(path[0]), dict) else {},
                                                       path[1:], value)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=3' -> ('a.b', 3). Values are read as YAML scalars/lists: 3, 1e-3, true, [8, 16], abc."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from None
    # YAML reads 1e-3 as a string (YAML 1.1); accept it as the number a user meant.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key, value


def nest(key: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
    return out


def load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def validate_tree(node, prefix: str = "") -> None:
    """Call every section's validate(); prefix its ValueError with the section's dotted path."""
    for f in dataclasses.fields(node):
        child = getattr(node, f.name)
        if dataclasses.is_dataclass(child):
            validate_tree(child, f"{prefix}{f.name}.")
    check = getattr(node, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{prefix}{e}") from None


def build(default, files: list[str] = (), overrides: list[str] = ()):
    """Defaults <- each YAML file in order <- each key=value override; then validate the tree."""
    cfg = default
    for path in files:
        cfg = merge(cfg, load_yaml(path))
    for text in overrides:
        key, value = parse_override(text)
        cfg = merge(cfg, nest(key, value))
    validate_tree(cfg)
    return cfg


def given_keys(files: list[str] = (), overrides: list[str] = ()) -> set[str]:
    """The dotted leaf keys that the YAML files and key=value overrides set (not the defaults)."""
    keys: set[str] = set()

    def walk(data, prefix: str) -> None:
        for name, value in data.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}.")
            else:
                keys.add(f"{prefix}{name}")

    for path in files:
        walk(load_yaml(path), "")
    for text in overrides:
        walk(nest(*parse_override(text)), "")
    return keys


def to_dict(node) -> dict:
    """Plain nested dict (tuples as lists) for YAML/JSON dumps."""
    out = {}
    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        elif isinstance(v, collections.abc.Mapping):
            out[f.name] = dict(v)
        else:
            out[f.name] = v
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config dicts keyed by their dotted config keys."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
