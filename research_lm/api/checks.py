"""Type checks for values users hand in (request fields, config dicts), shared by `SamplingParams`,
`speculative_config` and `eplb_config`: a wrong type is refused at the edge with the field's name, instead of
failing deep inside (`int('abc')` in the RNG, a float in `topk`) and taking the batch down with it.

    checked("SamplingParams.seed", value, "int?")   # -> an int or None, else ValueError naming the field

Kinds (a trailing "?" also takes None): int, posint (>= 1), count (>= 0), number (int or float, finite), bool,
str, path (str or os.PathLike), ints (a list of ints), strs (a string or a list of strings; a string becomes [s]),
tree (vLLM's speculative_token_tree, checked as a tree: research_lm/worker/token_tree.py).
numpy scalars pass as the Python type they stand for (and come back converted to it); bool is never a number.
"""

from __future__ import annotations

import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral, Real
from typing import Any


class InvalidType(TypeError, ValueError):
    """A value not of its field's kind: a TypeError, as Python names it, and a ValueError, as our edge checks (and
    the CLI, which turns them into one line) name what a user handed in wrongly."""


class _Bad(Exception):
    """A value not of its kind (turned into the ValueError that names the field)."""


def _int(v: Any) -> int:
    if isinstance(v, Integral) and not isinstance(v, bool):  # True is an int to Python, never a count here
        return int(v)
    raise _Bad


def _at_least(low: int) -> Callable[[Any], int]:
    def convert(v: Any) -> int:
        if (i := _int(v)) < low:
            raise _Bad
        return i

    return convert


def _number(v: Any) -> float:
    if isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise _Bad


def _instance(*types: type) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if isinstance(v, types):
            return v
        raise _Bad

    return convert


def _list_of(item: Callable[[Any], Any]) -> Callable[[Any], list]:
    def convert(v: Any) -> list:
        if isinstance(v, str | bytes | Mapping) or not isinstance(v, Iterable):  # "123" is not a list of ids
            raise _Bad
        return [item(x) for x in v]

    return convert


def _token_tree(v: Any) -> list[list[int]]:
    """vLLM's speculative_token_tree (a list of tuples of child ranks, or its string form), breadth-first; a tree
    that is no tree raises TokenTree.parse's ValueError, which names what is wrong."""
    from research_lm.worker.token_tree import TokenTree

    if not isinstance(v, str | list | tuple):
        raise _Bad
    return [list(path) for path in TokenTree.parse(v).paths]


# kind -> (the rule an error states, conversion to the plain Python value that raises _Bad)
KINDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "tree": ("a list of tuples of child ranks, as vLLM's speculative_token_tree", _token_tree),
    "int": ("an integer", _int),
    "posint": ("a positive integer", _at_least(1)),
    "count": ("a non-negative integer", _at_least(0)),
    "number": ("a finite number", _number),
    "bool": ("True or False", _instance(bool)),
    "str": ("a string", _instance(str)),
    "path": ("a path (a string)", _instance(str, os.PathLike)),
    "ints": ("a list of integers", _list_of(_int)),
    "strs": ("a string or a list of strings", lambda v: [v] if isinstance(v, str) else _list_of(_instance(str))(v)),
}


def checked(label: str, value: Any, kind: str) -> Any:
    """`value` as `kind`'s plain Python value; ValueError `<label> must be <rule>, got <value!r>` if it is not one."""
    optional = kind.endswith("?")
    rule, convert = KINDS[kind.removesuffix("?")]
    if value is None and optional:
        return None
    try:
        return convert(value)
    except _Bad:
        raise InvalidType(f"{label} must be {rule}{' or None' if optional else ''}, got {value!r}") from None


def matches_annotation(value: Any, tp: Any) -> bool:
    """Whether `value` is of the annotated type `tp` (unions, None, bool, int, float (an int is one), str, lists and
    tuples of those, dicts; anything else passes): what a dataclass field or a config key declares."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches_annotation(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:  # bool before int: True is an int to isinstance
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        fixed = origin is tuple and Ellipsis not in args
        return (isinstance(value, list | tuple) and (not fixed or len(value) == len(args))
                and all(matches_annotation(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    return True  # Any, or a type no config value is compared with


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def describe_annotation(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_annotation(a) for a in args)
    if origin in (list, tuple):
        count = f"{len(args)} " if origin is tuple and Ellipsis not in args else ""
        return f"a list of {count}{_PLURALS.get(args[0], 'values')}"
    return _NAMES.get(tp, getattr(tp, "__name__", str(tp)))
