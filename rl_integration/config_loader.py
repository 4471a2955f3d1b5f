"""Nested dataclasses from YAML, with dotted overrides: the mechanism under the run config.

    raw = read_yaml("run.yaml")                       # a mapping, or {} for no file
    apply_override(raw, "rollout.engine.spec.max_draft_tokens=16")
    cfg = from_dict(RunConfig, raw)                   # every key and type checked

An unknown key or a wrong type raises ValueError naming the dotted key (with the expected type, or
the known keys and a "did you mean"). Override values are parsed as YAML. A given section is merged
onto its default, so one key keeps the others' defaults; a key under a null section brings it
back. A `dict` field is a free-form mapping: a given one replaces the default as a whole.

A section may declare `RENAMED = {"old": "new"}`, `RENAMED_VALUES = {"key": {"old": "new"}}` and
`RENAMED_WHY`: an old name raises a ValueError saying the new one. `MOVED = {"old": "new.section"}`
names where a gone section's keys are set now; a field named there is left out of to_dict.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, Optional, Union

import yaml

_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def read_yaml(path: Optional[Union[str, os.PathLike]]) -> dict:
    """The mapping a YAML file holds ({} for no file or an empty one)."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {os.fspath(path)!r} does not exist") from None
    except OSError as e:  # a folder, no permission, ...
        raise ValueError(f"config file {os.fspath(path)!r} cannot be read: {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid YAML: {type(e).__name__}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {os.fspath(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict, item: str) -> None:
    """Set `a.b.c=value` in the raw mapping (value parsed as YAML)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # (ValueError: an int of thousands of digits)
        raise ValueError(f"override {item!r}: the value is not valid YAML: {e}") from None
    node, parts = raw, key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:  # absent, or a null section being brought back
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls, data: Any, prefix: str = "", base=None):
    """Dataclass `cls` from a mapping, keys and types checked; keys not given keep `base`'s values."""
    where = prefix or "the config"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"config key {where!r} must be a mapping (section {cls.__name__}), "
                         f"got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    _refuse_renamed(cls, data, prefix)
    for key in data:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {dotted!r}{hint}; known keys under {where}: {sorted(fields)}")
    base = cls() if base is None else base
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, dotted, getattr(base, name))
    return dataclasses.replace(base, **kwargs)


def _refuse_renamed(cls, data: dict, prefix: str) -> None:
    """A ValueError naming the new key (or value) for each old one `cls` declares renamed."""
    def dotted(k):
        return f"{prefix}.{k}" if prefix else str(k)
    why = getattr(cls, "RENAMED_WHY", "")
    why = f" ({why})" if why else ""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data:
            raise ValueError(f"config key {dotted(old)!r} was renamed {dotted(new)!r}{why}")
    for old, new in getattr(cls, "MOVED", {}).items():
        if old in data:
            sub = next(iter(data[old]), None) if isinstance(data[old], dict) else None
            example = f" ({dotted(old)}.{sub} is now {new}.{sub})" if sub is not None else ""
            raise ValueError(f"config key {dotted(old)!r} is gone: its keys are set under {new!r}{example}")
    for key, values in getattr(cls, "RENAMED_VALUES", {}).items():
        value = data.get(key)
        if isinstance(value, str) and value in values:
            raise ValueError(f"config key {dotted(key)!r}: the value {value!r} was renamed {values[value]!r}{why}")


def _convert(tp, value, key: str, current=None):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            if value is None:
                raise ValueError(f"config key {key!r}: expected {type_name(tp)}, got null")
            return _convert(inner[0], value, key, current)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key, current if isinstance(current, tp) else None)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise ValueError(f"config key {key!r}: expected one of {list(args)}, got {value!r}")
        return value
    converted = _scalar(tp, origin, args, value, key)
    if converted is not _NO:
        return converted
    raise ValueError(f"config key {key!r}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


_NO = object()


def _scalar(tp, origin, args, value, key: str):
    """value as a bool, int, float, str, list/tuple of them or a mapping, or _NO when it is not one."""
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads 3e-4 as a string: still a float here
        return _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        elem = args[0] if args else Any
        items = [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if (tp is dict or origin is dict) and isinstance(value, dict):
        return dict(value)  # free-form: its consumer checks the keys
    if tp is Any:
        return value
    return _NO


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return f"one of {list(args)}"
    if origin in (list, tuple):
        return f"a list of {type_name(args[0])}" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if tp is dict or origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def to_dict(cfg) -> dict:
    """Plain nested dict (lists for tuples), e.g. to save the resolved config as YAML."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            moved = getattr(v, "MOVED", {})
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if f.name not in moved}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(cfg)
