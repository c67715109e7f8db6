"""One validation rule per settings field, checked in one place.

Every settings class (``CheckpointConfig`` and its groups, ``CheckpointerOptions``,
``TransferConfig``, ``StorageOptions``) keeps a table ``{field: rule}`` covering each of its fields and
calls :func:`check` from ``__post_init__`` (s3transfer's
``TransferConfig._validate_attrs_are_nonzero`` is the model: a loop over a table, not
one hand-written ``if`` per field). The classes of ``cloudckpt.options`` derive their
table from the fields themselves (:func:`table`): a field declared with :func:`knob`
carries its rule, any other field gets the rule of its type (:func:`of_type`), so a new
setting is one field, its rule and its docstring in one place. A rule is a function of the value that returns
None when it is allowed, else what to write instead; :func:`check` turns that into one
``ConfigError`` naming the field, the value and what is allowed. Rules that relate two
fields (``min_concurrency <= max_concurrency``) follow the table in the class.

Values are checked as they are: strings from YAML or the environment are converted to
the field's type before (``cloudckpt.config``), so ``"5"`` is not an integer here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional, get_type_hints

from .errors import ConfigError

#: None when the value is allowed, else what is allowed ("use an integer >= 1").
Rule = Callable[[Any], Optional[str]]


def check(what: str, obj: Any, rules: Mapping[str, Rule]) -> None:
    """Apply ``rules`` to the attributes of ``obj``; raise ConfigError on the first
    value not allowed: ``{what}{field}={value!r} is not allowed: {what is allowed}``."""
    for name, rule in rules.items():
        value = getattr(obj, name)
        allowed = rule(value)
        if allowed is not None:
            raise ConfigError(f"{what}{name}={value!r} is not allowed: {allowed}")


def _or_none(ok: Callable[[Any], bool], allowed: str, none: str | None) -> Rule:
    """``ok`` decides; ``none`` (what None means) also allows None."""
    text = allowed if none is None else f"{allowed}, or None {none}"
    return lambda v: None if (none is not None and v is None) or (v is not None and ok(v)) else text


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def integer(at_least: int = 1, *, none: str | None = None, why: str = "") -> Rule:
    """An integer ``>= at_least`` (``why``: appended, e.g. what 0 would do); ``none``: None allowed, meaning that."""
    allowed = ("use a positive integer" if at_least == 1 else f"use an integer >= {at_least}") + why
    return _or_none(lambda v: _is_int(v) and v >= at_least, allowed, none)


def number(above: float = 0, *, strict: bool = False, finite: bool = True, unit: str = "seconds",
           none: str | None = None, why: str = "") -> Rule:
    """A number ``> above`` (``strict``) or ``>= above``; ``finite``: infinity refused."""
    if above == 0 and not strict:
        allowed = f"use a {'finite ' if finite else ''}non-negative number of {unit}" + why
    else:
        kind = "a finite number" if finite else "a number"
        allowed = f"use {kind} of {unit} {'>' if strict else '>='} {above:g}" + why
    return _or_none(lambda v: _is_num(v) and (v > above if strict else v >= above) and (v < math.inf or not finite),
                    allowed, none)


def boolean() -> Rule:
    return lambda v: None if isinstance(v, bool) else "use true or false"


def choice(*values: Any) -> Rule:
    allowed = "use " + " or ".join(repr(v) for v in values)
    return lambda v: None if any(v == x and type(v) is type(x) for x in values) else allowed


def text(*, none: str | None = None, ok: Callable[[str], bool] = lambda v: True, allowed: str = "use a string") -> Rule:
    """A string passing ``ok`` (``allowed`` says what passes)."""
    return _or_none(lambda v: isinstance(v, str) and ok(v), allowed, none)


def instance(cls: type) -> Rule:
    return lambda v: None if isinstance(v, cls) else f"use a {cls.__name__} or a mapping of its fields"


def knob(default: Any = dataclasses.MISSING, rule: Rule | None = None, *,
         default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying its rule (``None``: the rule of its type, :func:`of_type`)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"rule": rule})


#: The rule a field gets from its type when its :func:`knob` names none.
_BY_TYPE: dict[Any, Callable[[], Rule]] = {
    bool: boolean,
    int: lambda: integer(1),
    float: lambda: number(0),
    str: text,
}


def of_type(typ: Any) -> Rule | None:
    """The rule of a field of type ``typ``: ``bool`` true or false, ``int`` a positive
    integer, ``float`` a finite non-negative number, ``str`` a string, a dataclass an
    instance of it; None for any other type (its field must name a rule)."""
    if typ in _BY_TYPE:
        return _BY_TYPE[typ]()
    if dataclasses.is_dataclass(typ):
        return instance(typ)
    return None


@functools.cache
def table(cls: type) -> dict[str, Rule]:
    """``{field: rule}`` of the dataclass ``cls``: each field's :func:`knob` rule, else the
    rule of its type. Raises TypeError naming a field that has neither (a class that
    forgot a rule fails on import, not on a user's bad value)."""
    hints = get_type_hints(cls)
    out: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("rule") or of_type(hints[f.name])
        if rule is None:
            raise TypeError(f"{cls.__name__}.{f.name} ({hints[f.name]}) needs a rule: declare it with "
                            "rules.knob(default, rule)")
        out[f.name] = rule
    return out


def check_fields(what: str, obj: Any) -> None:
    """:func:`check` with the rules of ``obj``'s fields (:func:`table`)."""
    check(what, obj, table(type(obj)))
