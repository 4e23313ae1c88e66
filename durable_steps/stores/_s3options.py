"""S3Store's tunable options: defaults, ``DURABLE_STEPS_S3_*`` variables, URL parameters.

One table (:data:`_SPECS`) says what each option is and how a string spells
it, so the constructor, the environment and ``s3://bucket/prefix?name=value``
validate alike and name the offending option in the same words. Precedence:
an argument (or URL parameter) wins over the environment, which wins over the
default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote_plus, urlsplit

from ..errors import DefinitionError

__all__ = ["ENV_PREFIX", "S3Options", "parse_query", "resolve"]

ENV_PREFIX = "DURABLE_STEPS_S3_"


@dataclass(frozen=True)
class S3Options:
    """The resolved retry, timeout and verification settings of one store."""

    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    retry_attempts: int = 4
    retry_wait: float = 0.5
    retry_max_wait: float = 5.0
    verify_conditional_writes: bool = True

    @property
    def worst_case_seconds(self) -> float:
        """The longest an operation takes to give up on a service that never answers.

        Every attempt may spend ``connect_timeout`` connecting and then
        ``read_timeout`` waiting for the answer; between attempts, the backoff
        before retry ``n`` is at most ``min(retry_max_wait, retry_wait * 2**(n-1))``.
        (``read_timeout`` bounds each wait for bytes, so a server that
        trickles a byte at a time can take longer; a silent one cannot.)
        """
        waits = sum(
            min(self.retry_max_wait, self.retry_wait * 2.0**n)
            for n in range(self.retry_attempts - 1)
        )
        return self.retry_attempts * (self.connect_timeout + self.read_timeout) + waits


# name -> (type, lower bound, bound allowed, what a valid value is)
_SPECS: dict[str, tuple[type, float, bool, str]] = {
    "connect_timeout": (float, 0.0, False, "a number of seconds greater than 0, at most 3600"),
    "read_timeout": (float, 0.0, False, "a number of seconds greater than 0, at most 3600"),
    "retry_attempts": (int, 1.0, True, "a whole number of attempts, from 1 to 100"),
    "retry_wait": (float, 0.0, True, "a number of seconds from 0 to 3600"),
    "retry_max_wait": (float, 0.0, True, "a number of seconds from 0 to 3600"),
    "verify_conditional_writes": (bool, 0.0, True, "true or false"),
}
assert set(_SPECS) == {f.name for f in fields(S3Options)}
_URL_ONLY = ("endpoint_url",)  # the environment already has AWS_ENDPOINT_URL_S3
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _known() -> str:
    return ", ".join(sorted([*_SPECS, *_URL_ONLY]))


def _invalid(where: str, name: str, value: object) -> DefinitionError:
    return DefinitionError(f"{where}: {name}={value!r} is not {_SPECS[name][3]}")


def _valid(name: str, value: object) -> bool:
    kind, low, inclusive, _ = _SPECS[name]
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if not isinstance(value, int if kind is int else (int, float)):
        return False
    high = 100 if name == "retry_attempts" else 3600  # beyond: a typo, not a setting
    return math.isfinite(value) and (value > low or (inclusive and value == low)) and value <= high


def _check(where: str, name: str, value: object) -> Any:
    """Return ``value`` as the option's type, or raise DefinitionError naming it."""
    if not _valid(name, value):
        raise _invalid(where, name, value)
    return _SPECS[name][0](value)


def _from_text(where: str, name: str, text: str) -> Any:
    """Parse the string spelling of an option (URL query or environment)."""
    kind = _SPECS[name][0]
    word = text.strip().lower()
    value: object = word in _TRUE if kind is bool and word in _TRUE | _FALSE else None
    if kind is not bool:
        try:
            value = kind(word)
        except ValueError:
            value = None
    if value is None or not _valid(name, value):
        raise _invalid(where, name, text)
    return value


def parse_query(url: str) -> dict[str, Any]:
    """The options in the query of an ``s3://`` URL, as S3Store keyword arguments."""
    where = f"store URL {url!r}"
    options: dict[str, Any] = {}
    for field in filter(None, urlsplit(url).query.split("&")):
        name, equals, text = (unquote_plus(part) for part in field.partition("="))
        if not equals:
            raise DefinitionError(f"{where}: parameter {name!r} has no value (use name=value)")
        if name not in _SPECS and name not in _URL_ONLY:
            raise DefinitionError(
                f"{where}: unknown parameter {name!r}; the known ones are {_known()}"
            )
        if name in options:
            raise DefinitionError(f"{where}: parameter {name!r} is given twice")
        if name == "endpoint_url":
            endpoint = urlsplit(text)
            if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
                raise DefinitionError(
                    f"{where}: endpoint_url={text!r} is not an http:// or https:// URL"
                )
            options[name] = text
        else:
            options[name] = _from_text(where, name, text)
    return options


def resolve(given: Mapping[str, object], environ: Mapping[str, str]) -> S3Options:
    """Options from arguments (``None``: not given), else ``DURABLE_STEPS_S3_*``, else defaults."""
    for var in environ:
        if var.startswith(ENV_PREFIX) and var[len(ENV_PREFIX) :].lower() not in _SPECS:
            raise DefinitionError(
                f"unknown environment variable {var}; the known ones are "
                + ", ".join(ENV_PREFIX + name.upper() for name in sorted(_SPECS))
            )
    values: dict[str, Any] = {}
    for name in _SPECS:
        var = ENV_PREFIX + name.upper()
        if given.get(name) is not None:
            values[name] = _check(f"S3Store({name}=...)", name, given[name])
        elif var in environ:
            values[name] = _from_text(f"environment variable {var}", name, environ[var])
    return S3Options(**values)
