"""Property-based tests (hypothesis) of the run config loader: random YAML files and random
`key=value` overrides give a RunConfig or a ValueError naming the key (or the file, or the
override), never another exception; a loaded config survives a round trip through YAML.

Keys are drawn from RunConfig's dataclass fields by introspection, with values of the right type
and of any other, so the test follows renamed and moved keys without edits. The strict xfail
tests at the end are bugs the fuzzing found.
"""
import dataclasses
import types
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_integration.config import RunConfig, load_config
from rl_integration.config_loader import to_dict
from tests.fuzz_counts import count

# Input classes that break the loader on main today, left out of the draws (each has a strict
# xfail test below; remove the name here once it is fixed).
KNOWN_BUGS = frozenset()
FUZZ = settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


def _inner(tp):
    """The type inside Optional[...], else tp."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def config_keys(cls=RunConfig, prefix: str = "") -> dict:
    """{dotted key: type} of every leaf field, sections (dataclasses) included as keys too."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in getattr(cls, "MOVED", {}):  # set elsewhere in a run config (SpecConfig.drafter)
            continue
        key, tp = f"{prefix}{f.name}", hints[f.name]
        out[key] = tp
        if dataclasses.is_dataclass(_inner(tp)):
            out.update(config_keys(_inner(tp), key + "."))
    return out


def default_of(key: str):
    """RunConfig()'s value at a dotted key (None under a section that is null by default)."""
    node = RunConfig()
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


KEYS = config_keys()
LEAVES = sorted(k for k, tp in KEYS.items() if not dataclasses.is_dataclass(_inner(tp)))
SECTIONS = sorted(k for k in KEYS if k not in LEAVES)
# sections whose default differs from their class's defaults (task.embedded today): see
# test_bug_override_resets_a_sections_other_defaults
RESET_BY_OVERRIDE = sorted(k for k in SECTIONS if default_of(k) is not None and default_of(k) != _inner(KEYS[k])())

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.integers(), st.text(max_size=8),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["1e-3", "yes", "0x10", ""]))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                        max_leaves=6)


def value_for(tp):
    """Values of type tp (its edges and a few out-of-range ones included)."""
    tp_inner = _inner(tp)
    origin, args = typing.get_origin(tp_inner), typing.get_args(tp_inner)
    if tp_inner is bool:
        base = st.booleans()
    elif tp_inner is int:
        base = st.one_of(st.integers(-2, 64), st.integers(-2**70, 2**70))
    elif tp_inner is float:
        base = st.one_of(st.floats(-1, 2), st.floats(allow_nan=True, allow_infinity=True))
    elif tp_inner is str:
        base = st.text(max_size=10)
    elif origin is typing.Literal:
        base = st.sampled_from(args)
    elif origin in (list, tuple) and args:
        base = st.lists(value_for(args[0]), max_size=4)
    else:
        base = anything
    return st.one_of(base, st.none()) if tp_inner is not tp else base


@st.composite
def some_value(draw, key: str):
    """The key's default (as YAML would hold it) 4 times in 10, a value of its type 4 in 10, else anything."""
    k = draw(st.integers(0, 9))
    if k < 4:
        return plain(default_of(key))
    value = draw(value_for(KEYS[key]) if k < 8 else anything)
    if "zero_heads" in KNOWN_BUGS and key.rsplit(".", 1)[-1] in ("num_heads", "num_kv_heads") and value == 0:
        value = 1
    return value


def plain(value):
    return to_dict(value) if dataclasses.is_dataclass(value) else value


@st.composite
def settings_tree(draw) -> tuple[dict, list[str]]:
    """(a nested mapping of some keys with values of their type or any, the dotted keys set)."""
    tree, used = {}, []
    for key in draw(st.lists(st.sampled_from(LEAVES + SECTIONS), max_size=6, unique=True)):
        value = draw(some_value(key))
        node = tree
        *parents, last = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[last] = value
        used.append(key)
    if draw(st.integers(0, 9)) == 0:  # an unknown key somewhere
        section = draw(st.sampled_from([""] + [s + "." for s in SECTIONS]))
        name = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8))
        node = tree
        for p in section.strip(".").split(".") if section else []:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[name] = 1
        used.append(section + name)
    return tree, used


@st.composite
def overrides(draw) -> tuple[list[str], list[str]]:
    items, used = [], []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 9))
        if kind == 0:  # anything at all
            items.append(draw(st.text(max_size=20)))
            continue
        key = draw(st.sampled_from(LEAVES + SECTIONS))
        value = draw(some_value(key))
        text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        items.append(f"{key}={text}")
        used.append(key)
    return items, used


def prefixes(keys) -> set[str]:
    out = set()
    for k in keys:
        parts = k.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def load(path, items, used, test: str):
    """load_config's result, or None after a ValueError that names what was wrong."""
    try:
        cfg = load_config(path, items)
    except ValueError as e:
        msg = str(e)
        names = prefixes(used + [i.partition("=")[0].strip() for i in items]) | set(items) | {repr(i) for i in items}
        names |= {str(path)} if path is not None else set()
        names |= {repr(n)[1:-1] for n in names}  # (messages quote with repr: escapes)
        assert any(n and n in msg for n in names), f"the error {msg!r} names none of {sorted(names)}"
        count(test, "ValueError")
        return None
    assert isinstance(cfg, RunConfig)
    count(test, "loaded")
    return cfg


def round_trips(cfg, tmp_path) -> None:
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    again = tmp_path / "again.yaml"
    again.write_text(text)
    assert yaml.safe_dump(to_dict(load_config(again)), sort_keys=False) == text


@settings(FUZZ)
@given(tree=settings_tree(), ov=overrides())
def test_yaml_and_overrides_load_or_name_the_key(tmp_path, tree, ov):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree[0]))
    cfg = load(path, ov[0], tree[1] + ov[1], "load_config(yaml, overrides) examples")
    if cfg is not None:
        round_trips(cfg, tmp_path)


@settings(FUZZ)
@given(text=st.one_of(st.text(max_size=60), st.text("{}[]:,-&*!|>'\"#%@ \n\tabc01.", max_size=40)))
def test_any_text_file_loads_or_names_the_file(tmp_path, text):
    path = tmp_path / "any.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        parsed = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        parsed = None
    load(path, [], mapping_keys(parsed), "load_config(any text) examples")


def mapping_keys(node, prefix: str = "") -> list[str]:
    """The dotted keys of a parsed YAML tree."""
    if not isinstance(node, dict):
        return []
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        out += [key] + mapping_keys(v, key + ".")
    return out


# ---- bugs the fuzzing found on main -----------------------------------------------------------


def refuses(path, items, *names) -> None:
    with pytest.raises(ValueError) as info:
        load_config(path, items)
    assert any(n in str(info.value) for n in names), str(info.value)


def test_refused_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"output: {dir: caf\xe9}\n")
    refuses(path, [], str(path))


def test_refused_config_path_is_a_folder(tmp_path):
    refuses(tmp_path, [], str(tmp_path))


def test_refused_deeply_nested_yaml(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("output: " + "[" * 3000 + "]" * 3000)
    refuses(path, [], str(path), "output")


def test_refused_huge_integer_override():
    key = next(k for k in LEAVES if _inner(KEYS[k]) is int)
    refuses(None, [f"{key}={'9' * 5000}"], key)


def test_refused_device_is_not_validated():
    keys = [k for k in LEAVES if k.rsplit(".", 1)[-1] == "device"]
    assert len(keys) >= 2
    for key in keys:
        refuses(None, [f"{key}=quantum"], key)


def test_refused_seed_out_of_range():
    keys = [k for k in LEAVES if k.rsplit(".", 1)[-1] == "seed" and _inner(KEYS[k]) is int]
    assert len(keys) >= 2
    for key in keys:
        refuses(None, [f"{key}={2**70}"], key)


def test_refused_zero_heads():
    keys = [k for k in LEAVES if k.rsplit(".", 1)[-1] in ("num_heads", "num_kv_heads")]
    assert keys
    for key in keys:
        refuses(None, [f"{key}=0"], key.rsplit(".", 1)[0])


def test_every_introspected_key_takes_its_default_as_an_override():
    assert len(LEAVES) > 40 and "trainer" in SECTIONS
    for key in LEAVES:
        if default_of(key.rsplit(".", 1)[0]) is None or any(key.startswith(s + ".") for s in RESET_BY_OVERRIDE):
            continue  # under a section that is null by default, or under a known bug
        text = yaml.safe_dump(plain(default_of(key)), default_flow_style=True, width=10**9)
        text = text.strip().removesuffix("...").strip()
        assert load_config(None, [f"{key}={text}"]) == RunConfig(), key


def test_an_override_keeps_a_sections_other_defaults():
    assert RESET_BY_OVERRIDE, "no section with its own defaults left: drop this test"
    for section in RESET_BY_OVERRIDE:
        key = next(k for k in LEAVES if k.startswith(section + "."))
        text = yaml.safe_dump(plain(default_of(key)), default_flow_style=True).strip().removesuffix("...").strip()
        assert load_config(None, [f"{key}={text}"]) == RunConfig(), key
