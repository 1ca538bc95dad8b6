"""Validate a `python -m research_lm` command line before Hydra runs it, so a bad value becomes one line.

Hydra reports its own errors (an override it cannot parse, a key the config lacks, a missing option) as
several lines and exit code 1, and a value of the wrong type passes through it to fail deep in the engine
with a TypeError. Here the command line is composed first through Hydra's compose API, which raises
those errors instead of printing them, and the composed values are checked against the dataclasses they
fill (`EngineConfig`, `WorkloadSpec`, `SamplingParams`), all before any model is built. Every problem
raises `UsageError` with one line naming the key; `research_lm.__main__` prints it and exits 2.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser  # the parser @hydra.main reads sys.argv with
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from research_lm.api.checks import describe_annotation, matches_annotation
from research_lm.api.config import EngineConfig
from research_lm.api.errors import RankLostError
from research_lm.api.sampling_params import SamplingParams
from research_lm.harness.workloads import WORKLOAD_KINDS, WorkloadSpec


class UsageError(ValueError):
    """A bad command line: the message is the one line the user sees."""


# Errors a run raises because of what the user asked for (a value, a path), not because of a bug: the CLI prints
# their first line and exits 2. Anything else keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
               MissingMandatoryValue, InterpolationResolutionError, RankLostError)


def one_line(e: BaseException) -> str:
    """The line the CLI prints for a USER_ERRORS exception: its first line, with the config key OmegaConf
    knows (its own messages put that on a later line)."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    key = getattr(e, "full_key", None) if isinstance(e, OmegaConfBaseException) else None
    return f"{key}: {first}" if key and key not in first else first


def check_command_line(argv: list[str], conf_dir: Path) -> None:
    """Raise UsageError for the first bad flag, override or value of `argv` (sys.argv[1:])."""
    parser = get_args_parser()
    parser.error = _raise_usage  # argparse would print its usage block first: keep to one line
    args = parser.parse_args(argv)
    if (args.help or args.hydra_help or args.shell_completion or args.config_path or args.config_dir
            or args.experimental_rerun):
        return  # help, configs from elsewhere or a pickled job: Hydra's business
    jobs = _jobs(args.overrides, args.multirun)
    inspect_only = bool(args.cfg or args.info)  # printing the config is how one finds a missing value
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3", job_name="research_lm"):
        for overrides in jobs:
            cfg = _compose(args.config_name or "config", overrides)
            if not inspect_only:
                check_config(cfg)


def _raise_usage(message: str) -> typing.NoReturn:
    if message.startswith("unrecognized arguments"):  # argparse reads no override after a flag that follows one
        message += " (put flags such as -m or --cfg before the overrides)"
    raise UsageError(message)


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists to compose: the command line as is; under -m, the sweep's first job and, for each
    other value of a swept key, the first job with that value (every value is composed once, not every
    combination: a sweep of n values over k keys costs 1 + k(n - 1) compositions of ~0.1 s)."""
    parser = OverridesParser.create()
    parsed = []
    for arg in overrides:  # one at a time, to name the one that does not parse
        try:
            parsed.append(parser.parse_override(arg))
        except HydraException as e:  # parse_override raises the grammar's message alone
            raise UsageError(_parse_error(arg, e)) from None
    if not multirun:
        for o in parsed:
            if o.is_sweep_override():
                raise UsageError(f"{o.input_line!r} gives several values: add -m to sweep over them, or write "
                                 f"{o.get_key_element()}=[...] for a list")
        return [overrides]
    values: dict[str, list[str]] = {}  # as Hydra's BasicSweeper splits them; a later override of a key wins
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            values[key] = [f"{key}={o.get_value_element_as_str()}"]
        elif o.is_discrete_sweep():
            values[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            raise UsageError(f"{o.input_line!r}: -m sweeps a list of values (a,b or range(...)), not an interval")
    lists = list(values.values())
    first = [v[0] for v in lists]
    return [first] + [first[:i] + [v] + first[i + 1:] for i, vs in enumerate(lists) for v in vs[1:]]


def _parse_error(arg: str, e: HydraException) -> str:
    lines = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.startswith(("Error parsing override", "See https://"))]
    reason = lines[0].split(" expecting ")[0] if lines else "bad syntax"  # ANTLR's token list helps no one
    if reason.startswith("missing EQUAL"):
        reason = "no '='"
    return f"cannot parse {arg!r}: {reason} (write key=value, group=option, +key=value or ~key)"


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name=config_name, overrides=overrides)
    except MissingConfigException as e:  # an option Hydra cannot find (hydra/launcher=nope, a preset's default)
        first = str(e).splitlines()[0]
        raise UsageError(f"{first}; choose one of: {', '.join(e.options)}" if e.options else first) from None
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UsageError(_hydra_error(e)) from None


def _hydra_error(e: Exception) -> str:
    cause = e.__cause__
    unknown = re.match(r"Could not override '([^']+)'", str(e))
    if unknown and isinstance(cause, ConfigKeyError | ConfigAttributeError):  # a key the config does not have
        key = unknown.group(1)
        root = cause.parent_node._get_root() if cause.parent_node is not None else None
        close = difflib.get_close_matches(key, _paths(root, key.startswith("hydra.")), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "python -m research_lm --cfg job lists the keys"
        return f"unknown config key {key!r}; {hint}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(cause, OmegaConfBaseException):  # e.g. a bad value for one of Hydra's own typed keys
        lines.append(str(cause).splitlines()[0])
    return "; ".join(lines) or type(e).__name__


def _paths(node: Any, with_hydra: bool, prefix: str = "") -> list[str]:
    """Every dotted key path under a composed config (candidates for 'did you mean')."""
    if not isinstance(node, DictConfig):
        return []
    out = []
    for key in node.keys():
        path = f"{prefix}{key}"
        if path == "hydra" and not with_hydra:
            continue
        out.append(path)
        out += _paths(node._get_node(key), with_hydra, path + ".")
    return out


def check_config(cfg: DictConfig) -> None:
    """Raise UsageError naming the key of the first value of the wrong type, out of range, missing or naming
    a path that cannot be read. Cheap (no model, no file read): also run by each job of a sweep."""
    missing = _missing(cfg)
    if missing:
        raise UsageError(f"{missing[0]} is required: add {missing[0]}=<value> to the command line")
    types_ = _expected_types(cfg)
    values = {key: _value(cfg, key) for key in types_}
    for key, tp in types_.items():
        if not matches_annotation(values[key], tp):
            raise UsageError(f"{key} must be {describe_annotation(tp)}, got {values[key]!r}")
    _check_ranges(values)
    _check_paths(cfg)


def _missing(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys left `???` (OmegaConf.missing_keys would also resolve every interpolation, and fail on a bad one)."""
    out = []
    for key in node.keys():
        child = node._get_node(key)
        if OmegaConf.is_missing(node, key):
            out.append(f"{prefix}{key}")
        elif isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            out += _missing(child, f"{prefix}{key}.")
    return out


# EngineConfig fields filled from outside the runner group (experiment.engine_config): field -> config key
_ENGINE_KEYS = {"seed": "seed", "device": "device", "dtype": "model.dtype", "max_model_len": "model.max_model_len",
                "trust_remote_code": "model.trust_remote_code", "load_format": "model.load_format"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seed")  # workloads._params


def _expected_types(cfg: DictConfig) -> dict[str, Any]:
    """Config key -> the type of the dataclass field its value fills, for the keys this config has."""
    engine = typing.get_type_hints(EngineConfig)
    workload = typing.get_type_hints(WorkloadSpec)
    out: dict[str, Any] = {"warmup_requests": int, "deterministic": bool}
    out |= {key: engine[field] for field, key in _ENGINE_KEYS.items()}
    out |= {f"runner.{k}": engine[k] for k in cfg.get("runner") or {} if k in engine}
    out |= {f"workload.{k}": workload[k] for k in cfg.get("workload") or {} if k in workload}
    return {key: tp for key, tp in out.items() if _has(cfg, key)}


def _has(cfg: DictConfig, key: str) -> bool:
    """Whether the config has `key`, without resolving it (select's default would also stand for a value whose
    interpolation fails, which _value reports)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or node._is_interpolation() or part not in node.keys():
            return False
        node = node._get_node(part)
    return True


def _value(cfg: DictConfig, key: str) -> Any:
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException as e:  # e.g. an interpolation to a key that does not exist
        raise UsageError(f"{key}: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _check_ranges(values: dict[str, Any]) -> None:
    """The dataclasses' own checks (they raise ValueError naming their field), then the workload's keys that no
    dataclass checks. Types are right by now."""
    engine_fields = {k.removeprefix("runner."): k for k in values if k.startswith("runner.")}
    engine_fields |= {f: k for f, k in _ENGINE_KEYS.items() if k in values}
    sampling_fields = {f: f"workload.{f}" for f in _SAMPLING_FIELDS if f"workload.{f}" in values}
    for cls, fields in ((EngineConfig, engine_fields), (SamplingParams, sampling_fields)):
        try:
            cls(**{f: values[k] for f, k in fields.items()})
        except ValueError as e:
            raise UsageError(_name_key(str(e).splitlines()[0], cls.__name__, fields)) from None
    rules = [
        ("workload.kind", lambda v: v in WORKLOAD_KINDS, f"must be one of {', '.join(WORKLOAD_KINDS)}"),
        ("workload.num_requests", lambda v: v >= 1, "must be >= 1"),
        ("workload.prompt_chars", lambda v: v >= 1, "must be >= 1"),
        ("workload.input_len", lambda v: 1 <= v[0] <= v[1], "must be [min, max] with 1 <= min <= max"),
        ("workload.output_len", lambda v: 1 <= v[0] <= v[1], "must be [min, max] with 1 <= min <= max"),
        ("workload.request_rate", lambda v: v is None or v > 0, "must be > 0 (or null: all arrive at once)"),
        ("workload.burstiness", lambda v: v > 0, "must be > 0"),
        ("warmup_requests", lambda v: v >= 0, "must be >= 0"),
    ]
    for key, ok, rule in rules:
        if key in values and not ok(values[key]):
            raise UsageError(f"{key} {rule}, got {values[key]!r}")


def _name_key(message: str, cls: str, fields: dict[str, str]) -> str:
    """'max_num_seqs must be >= 1' or 'SamplingParams.temperature must ...' -> the same about the config key."""
    field, sep, rest = message.removeprefix(f"{cls}.").partition(" ")
    return f"{fields[field]}{sep}{rest}" if field in fields else message


def _check_paths(cfg: DictConfig) -> None:
    """The checkpoint and prompt file the run will open exist and can be read (the loaders say the same, but
    only after the run folder, and maybe a random model, were built)."""
    model, spec, workload = cfg.get("model") or {}, cfg.get("spec") or {}, cfg.get("workload") or {}
    if cfg.get("task") == "generate":  # the other tasks name their models elsewhere (train.target, eplb_replay)
        if not model.get("random"):  # a random model is built, not read
            _checkpoint("model.name", model.get("name"))
        if model.get("tokenizer") is not None and not Path(str(model.tokenizer)).expanduser().is_dir():
            raise UsageError(f"model.tokenizer: no directory {str(model.tokenizer)!r}")
        if spec.get("method") and spec.get("model") is not None:
            _checkpoint("spec.model", spec.get("model"))
    if workload.get("kind") == "jsonl":
        path = Path(str(workload.get("path"))).expanduser()
        if not path.is_file():
            raise UsageError(f"workload.path: no file {str(path)!r}" + (" (a directory)" if path.is_dir() else ""))
        if not os.access(path, os.R_OK):
            raise UsageError(f"workload.path: cannot read {str(path)!r} (permission denied)")


def _checkpoint(key: str, name: Any) -> None:
    from research_lm.models.loader import builtin_models, read_json_config, resolve_model_path

    try:
        path = resolve_model_path(str(name))
    except ValueError:
        raise UsageError(f"{key}: {str(name)!r} is neither a checkpoint directory nor a built-in model "
                         f"(built-ins: {', '.join(builtin_models()) or 'none'})") from None
    if not path.is_dir():
        raise UsageError(f"{key}: {str(path)!r} is a file, not a checkpoint directory")
    try:
        read_json_config(path)  # the loaders' own reading: missing, unreadable or not a JSON object
    except ValueError as e:
        raise UsageError(f"{key}: {e}") from None

