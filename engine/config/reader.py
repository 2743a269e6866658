"""Strict, path-aware reading of one JSON object (a config section).

Every value is read through a :class:`Section`, which knows the section's key path
(``zero_optimization``), the keys it accepts, the DeepSpeed keys it rejects (with the
reason), and the keys it accepts only at their default value. All problems become a
:class:`~engine.errors.ConfigError` that names the full key path and the fix.

JSON has one number type, so an integral float (``5e8``) is accepted where an integer
is expected and converted; ``true``/``false`` are never numbers.
"""

from __future__ import annotations

import builtins
import difflib
import json
import math
import os
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from engine.errors import ConfigError
from engine.validate import as_int, int_requirement

__all__ = ["AUTO", "Section", "key_path", "read_json_file", "did_you_mean", "show"]

AUTO = "auto"
_MISSING = object()


def key_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``""`` when none is close."""
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    if not close:
        # Case-insensitive second try: "Stage" -> "stage", "FP16" -> "fp16".
        lower = {c.lower(): c for c in candidates}
        hit = difflib.get_close_matches(key.lower(), sorted(lower), n=1, cutoff=0.6)
        close = [lower[hit[0]]] if hit else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def show(v: Any) -> str:
    """``v`` as it would be written in JSON, or its repr when it is not JSON."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


class Section:
    """One JSON object at ``path``, read key by key.

    ``accepted``: keys this section understands.
    ``rejected``: DeepSpeed keys we refuse whatever their value, key -> reason and fix.
    ``fixed``: DeepSpeed keys accepted only at one value, key -> (allowed, reason); they
    are validated here and not stored (they can only hold their default).
    ``aliases``: alternative spellings DeepSpeed also accepts, alias -> canonical key.
    ``ignored_bools``: DeepSpeed switches that have no effect here; type-checked, not stored.
    Unknown keys are rejected with a "did you mean" suggestion, before any value is read,
    so a misspelt key is reported as such rather than as a missing value.
    """

    def __init__(
        self,
        data: Any,
        path: str,
        accepted: Sequence[str],
        *,
        rejected: Optional[Mapping[str, str]] = None,
        fixed: Optional[Mapping[str, tuple[Any, str]]] = None,
        aliases: Optional[Mapping[str, str]] = None,
        ignored_bools: Sequence[str] = (),
    ) -> None:
        where = path or "the top level of the config"
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object, got {_type_name(data)} ({show(data)})")
        self.path = path
        self.accepted = tuple(accepted)
        rejected = dict(rejected or {})
        fixed = dict(fixed or {})
        aliases = dict(aliases or {})
        values: dict[str, Any] = {}
        spelled: dict[str, str] = {}  # canonical key -> the spelling used in the file
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: keys must be strings, got {key!r}")
            full = key_path(path, key)
            if key in rejected:
                raise ConfigError(f"{full} is not supported: {rejected[key]}")
            if key in fixed:
                allowed, reason = fixed[key]
                if value is not None and not _same(value, allowed):  # null: DeepSpeed's "unset"
                    raise ConfigError(f"{full} = {show(value)} is not supported ({reason}): "
                                      f"remove the key or set it to {show(allowed)}")
                continue
            if key in ignored_bools:
                if not isinstance(value, bool):
                    raise ConfigError(f"{full} must be true or false, got {_type_name(value)} ({show(value)})"
                                      f"{_type_fix(value, 'bool')}")
                continue
            canonical = aliases.get(key, key)
            if canonical not in self.accepted:
                known = set(self.accepted) | set(fixed) | set(aliases) | set(ignored_bools) | set(rejected)
                raise ConfigError(f"unknown key {full}{did_you_mean(key, known)}; accepted keys in "
                                  f"{where}: {', '.join(sorted(self.accepted))}")
            if canonical in values:
                first = key_path(path, spelled[canonical])
                raise ConfigError(f"{first} and {full} are two spellings of the same setting: keep only "
                                  f"{key_path(path, canonical)}")
            values[canonical] = value
            spelled[canonical] = key
        self._values = values

    # ---------------------------------------------------------------- basics
    def full(self, key: str) -> str:
        return key_path(self.path, key)

    def has(self, key: str) -> bool:
        return key in self._values

    def raw(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def is_auto(self, key: str) -> bool:
        return self._values.get(key, _MISSING) == AUTO

    def _get(self, key: str, default: Any, required: bool, auto_hint: str) -> Any:
        if key not in self._values:
            if required:
                raise ConfigError(f"{self.full(key)} is required: add it to {self.path or 'the config'}")
            return _MISSING if default is _MISSING else default
        v = self._values[key]
        if isinstance(v, str) and v == AUTO:
            raise ConfigError(f"{self.full(key)} = \"auto\" cannot be resolved by the config loader"
                              f"{auto_hint}: set an explicit value")
        return v

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.full(key)} {message}")

    def sub(self, key: str, accepted: Sequence[str], **kw: Any) -> "Section":
        """The nested object at ``key`` (absent or null -> empty)."""
        v = self._values.get(key)
        return Section({} if v is None else v, self.full(key), accepted, **kw)

    # --------------------------------------------------------------- getters
    def bool(self, key: str, default: Any = _MISSING, *, required: bool = False, auto_hint: str = "") -> bool:
        v = self._get(key, default, required or default is _MISSING, auto_hint)
        if not isinstance(v, bool):
            raise self.error(key, f"must be true or false, got {_type_name(v)} ({show(v)}){_type_fix(v, 'bool')}")
        return v

    def int(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        min: Optional[int] = None,
        max: Optional[int] = None,
        required: builtins.bool = False,
        nullable: builtins.bool = False,
        auto_hint: str = "",
    ) -> Any:
        v = self._get(key, default, required or default is _MISSING, auto_hint)
        if v is None and nullable:
            return None
        v = as_int(v, allow_float=True)  # JSON writes 5e8 as a float
        if v is None:
            raw = self._values.get(key, default)
            kind = "an integer" + (" or null" if nullable else "")
            raise self.error(key, f"must be {kind}, got {_type_name(raw)} ({show(raw)}){_type_fix(raw, 'number')}")
        _check_range(self, key, v, min, max)
        return v

    def number(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        min: Optional[float] = None,
        max: Optional[float] = None,
        min_exclusive: builtins.bool = False,
        required: builtins.bool = False,
        auto_hint: str = "",
    ) -> float:
        v = self._get(key, default, required or default is _MISSING, auto_hint)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(key, f"must be a number, got {_type_name(v)} ({show(v)}){_type_fix(v, 'number')}")
        if not math.isfinite(v):
            raise self.error(key, f"must be a finite number, got {v!r}")
        v = float(v)
        if min is not None and (v <= min if min_exclusive else v < min):
            op = ">" if min_exclusive else ">="
            raise self.error(key, f"must be {op} {min:g}, got {v:g}: set a value in that range")
        if max is not None and v > max:
            raise self.error(key, f"must be <= {max:g}, got {v:g}: set a value in that range")
        return v

    def choice(
        self,
        key: str,
        choices: Sequence[str],
        default: Any = _MISSING,
        *,
        case_insensitive: builtins.bool = False,
        required: builtins.bool = False,
        auto_hint: str = "",
    ) -> str:
        v = self._get(key, default, required or default is _MISSING, auto_hint)
        if isinstance(v, str):
            if v in choices:
                return v
            if case_insensitive:
                for c in choices:
                    if c.lower() == v.lower():
                        return c
        options = " | ".join(f'"{c}"' for c in choices)
        hint = did_you_mean(v, choices) if isinstance(v, str) else ""
        raise self.error(key, f"must be one of {options}, got {show(v)}{hint}")

    def optional_str(self, key: str, default: Optional[str] = None) -> Optional[str]:
        v = self._get(key, default, False, "")
        if v is None:
            return None
        if not isinstance(v, str) or not v:
            raise self.error(key, f"must be a non-empty string or null, got {_type_name(v)} ({show(v)})")
        return v

    def str_list(self, key: str, *, nullable: builtins.bool = True) -> Optional[tuple[str, ...]]:
        v = self._get(key, None, False, "")
        if v is None and nullable:
            return None
        if not isinstance(v, list) or not v:
            raise self.error(key, f"must be a non-empty list of strings{' or null' if nullable else ''}, "
                                  f"got {_type_name(v)} ({show(v)})")
        for i, item in enumerate(v):
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{self.full(key)}[{i}] must be a non-empty string, got {show(item)}")
        return tuple(v)

    def number_pair(self, key: str, default: tuple[float, float], *, lo: float, hi: float) -> tuple[float, float]:
        """Two numbers in ``[lo, hi)`` (Adam/Lion ``betas``)."""
        v = self._get(key, default, False, "")
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise self.error(key, f"must be a list of two numbers like [0.9, 0.999], got {show(v)}")
        out = []
        for i, b in enumerate(v):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not lo <= b < hi:
                raise ConfigError(f"{self.full(key)}[{i}] must be a number in [{lo:g}, {hi:g}), got {show(b)}")
            out.append(float(b))
        return (out[0], out[1])


def _same(value: Any, allowed: Any) -> bool:
    # `False == 0` in Python; a fixed boolean must be given as a boolean (and vice versa).
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    return value == allowed


def _check_range(sec: Section, key: str, v: int, lo: Optional[int], hi: Optional[int]) -> None:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise sec.error(key, f"must be {int_requirement(lo, hi)}, got {v}: set a value in that range")


def _type_fix(v: Any, want: str) -> str:
    """A hint for the common slips: a quoted number or boolean, a boolean for a number."""
    if isinstance(v, str):
        if v.lower() in ("true", "false") and want == "bool":
            return f": write {v.lower()} without quotes"
        try:
            float(v)
            return f": write {v} without quotes" if want == "number" else ""
        except ValueError:
            return ""
    if isinstance(v, bool) and want == "number":
        return ": write a number, not true/false"
    if isinstance(v, (int, float)) and want == "bool":
        return ": write true or false, not a number"
    return ""


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"duplicate key '{k}' in the JSON object with keys {[p[0] for p in pairs]}: "
                              "JSON would silently keep the last one; keep exactly one")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not valid JSON: write a finite number")


MAX_INT_DIGITS = 30  # no config value needs more (2**64 has 20 digits)
MAX_DEPTH = 64  # DeepSpeed configs nest 4 deep; a deeper file is not a config


def _parse_int(text: str) -> int:
    """JSON integers, refusing ones no config value needs before Python's int-str limit
    (4300 digits) raises a bare ValueError."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ConfigError(f"an integer of {digits} digits ({text[:12]}...): no config value has more than "
                          f"{MAX_INT_DIGITS}")
    return int(text)


def _check_depth(text: str, path: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before the parser recurses into it (a 200,000-deep
    array exhausts the recursion limit). Brackets inside strings are skipped."""
    depth, in_str, escaped = 0, False, False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{path}: nested more than {MAX_DEPTH} levels deep: not a config (DeepSpeed's "
                                  "nest 4 levels)")
        elif ch in "]}":
            depth -= 1


def read_json_file(path: Union[str, "os.PathLike[str]"]) -> Any:
    """Parse a JSON file, rejecting duplicate keys, NaN/Infinity, integers of more than
    :data:`MAX_INT_DIGITS` digits and nesting deeper than :data:`MAX_DEPTH`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {e.strerror or e}") from None
    _check_depth(text, os.fspath(path))
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant,
                          parse_int=_parse_int)
    except ConfigError as e:
        raise ConfigError(f"{os.fspath(path)}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{os.fspath(path)} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                          "(JSON allows no comments and no trailing commas)") from None
    except (ValueError, RecursionError, MemoryError) as e:  # any other failure of the parser: still one line
        raise ConfigError(f"{os.fspath(path)} cannot be read as JSON: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None

