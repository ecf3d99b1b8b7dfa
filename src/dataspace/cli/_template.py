"""Values with holes, for the commands that make values from others: ``reply --with
'<Answer $id "12:00">'`` (a request's captures) and ``send --count N '<Tick $n>'`` (the
message's number).

A template is Preserves text in which a symbol ``$NAME`` is a hole, filled with the value
of the slot of that name; ``$$x`` is the literal symbol ``$x`` (as in patterns).  Holes
may stand anywhere a value may, except as a record's label or a dictionary's key (those
are literal).  A hole naming no slot is an error when the template is read, with the
slots there are, so that a typo never sends ``$idd`` as a symbol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..values import (
    Dictionary,
    ParseError,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    parse,
    stringify,
    strip,
)

__all__ = ["Template", "TemplateError"]


class TemplateError(ValueError):
    """A template that cannot be used (the message says why, for the user)."""


Fill = Callable[[tuple[Value, ...]], Value]


class Template:
    """``text`` with its ``$NAME`` holes bound to slots: :meth:`fill` with a tuple of
    values makes the value (``slots`` maps each hole's name to its index in the tuple)."""

    def __init__(self, text: str | Value, slots: Mapping[str, int], *, what: str = "") -> None:
        """``text``: Preserves text, or a value already read; ``what`` names the template
        in errors (an option: ``--with``)."""
        if isinstance(text, str):
            try:
                value = parse(text)
            except ParseError as e:
                raise TemplateError(f"{what + ': ' if what else ''}cannot read {text!r} as "
                                    f"a value: {e}") from None
        else:
            value, text = text, stringify(text)
        self.text = text
        self.slots = dict(slots)
        self.used: set[str] = set()
        self._what = what
        self._fill = self._compile(strip(value), 0)

    def fill(self, values: tuple[Value, ...]) -> Value:
        """The template with each hole replaced by its slot's value."""
        return self._fill(values)

    def _hole(self, name: str) -> Fill:
        if name not in self.slots:
            have = ", ".join("$" + n for n in self.slots) or "none"
            raise TemplateError(f"{self._what + ' ' if self._what else ''}{self.text}: ${name} "
                                "names nothing to fill in "
                                f"(it may use {have}); write $${name} for the symbol ${name}")
        self.used.add(name)
        i = self.slots[name]
        return lambda vs: vs[i]

    def _compile(self, v: Value, depth: int) -> Fill:
        if depth > 500:
            raise TemplateError(f"{self._what or 'the value'} is nested more than 500 levels "
                                "deep")
        t = type(v)
        if t is Symbol:
            name = v.name
            if name.startswith("$$"):
                return _constant(Symbol(name[1:]))
            if name.startswith("$"):
                return self._hole(name[1:])
            return _constant(v)
        if t is Record:
            label = _literal(v.label)
            parts = [self._compile(strip(f), depth + 1) for f in v.fields]
            if _constants(parts):
                return _constant(Record(label, [p(()) for p in parts]))
            return lambda vs: Record(label, [p(vs) for p in parts])
        if t is Sequence or t is Set:
            parts = [self._compile(strip(x), depth + 1) for x in v]
            if _constants(parts):
                return _constant(t([p(()) for p in parts]))
            return lambda vs: t([p(vs) for p in parts])
        if t is Dictionary:
            items = [(_literal(k), self._compile(strip(x), depth + 1)) for k, x in v.items()]
            if _constants([p for _k, p in items]):
                return _constant(Dictionary([(k, p(())) for k, p in items]))
            return lambda vs: Dictionary([(k, p(vs)) for k, p in items])
        return _constant(v)


def _constant(v: Value) -> Fill:
    def f(vs: tuple[Value, ...]) -> Value:
        return v

    f.constant = True  # type: ignore[attr-defined]
    return f


def _constants(parts: list[Fill]) -> bool:
    return all(getattr(p, "constant", False) for p in parts)


def _literal(v: Value) -> Value:
    """A label or key: ``$$x`` is the symbol ``$x``; a hole is not allowed there."""
    if type(v) is Symbol and v.name.startswith("$"):
        if v.name.startswith("$$"):
            return Symbol(v.name[1:])
        raise TemplateError(f"{v.name} cannot be filled in as a record's label or a "
                            f"dictionary's key (they are literal); write ${v.name} for the "
                            "symbol itself")
    return v


def capture_slots(names: list[str | None]) -> dict[str, int]:
    """The slots of a pattern's captures: each by its number from 1 (``$1`` is the
    first capture), and each named one by its name too (a name wins over a number)."""
    slots = {str(i): i - 1 for i in range(1, len(names) + 1)}
    for i, n in enumerate(names):
        if n:
            slots[n] = i
    return slots


def as_text_arg(v: Value) -> str:
    """A value as a command's environment gets it: a string's own characters, any other
    value as Preserves text."""
    if type(v) is str and "\0" not in v:
        return v
    return stringify(v)

