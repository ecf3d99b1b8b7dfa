"""Errors raised when reading Preserves text or bytes.

All are ``ValueError`` subclasses carrying the offending ``position`` (a byte offset for
binary input, a character offset for text), so callers can catch ``ValueError`` for "bad
input" and still tell the cases apart:

* :class:`DecodeError` -- malformed binary input.  :class:`DecodeShort` (a subclass) means
  the input ended in the middle of a value: with more bytes it might be fine (a stream
  reader waits for more); :class:`DecodeEOF` means there was no value at all.
* :class:`ParseError` -- malformed text.  :class:`ParseShort` / :class:`ParseEOF` likewise.
* :class:`LimitExceeded` -- input within the syntax but beyond a configured limit (nesting
  depth, declared length, total size).  It is a ``DecodeError`` or ``ParseError`` too.
"""

from __future__ import annotations

__all__ = [
    "PreservesError",
    "DecodeError",
    "DecodeShort",
    "DecodeEOF",
    "ParseError",
    "ParseShort",
    "ParseEOF",
    "DecodeLimitExceeded",
    "DecodeTooLarge",
    "ParseLimitExceeded",
    "LimitExceeded",
]


class PreservesError(ValueError):
    """Base class: bad Preserves input.  ``position`` says where."""

    def __init__(self, message: str, position: int | None = None) -> None:
        self.message = message
        self.position = position
        super().__init__(message if position is None else f"{message} (at position {position})")


class DecodeError(PreservesError):
    """Malformed binary Preserves input."""


class DecodeShort(DecodeError):
    """Binary input ended before the value was complete (more bytes may fix it)."""


class DecodeEOF(DecodeShort):
    """Binary input held no value at all."""


class ParseError(PreservesError):
    """Malformed Preserves text.

    When the parser knows where, ``line`` and ``column`` (both from 1) locate the error
    in the text that was parsed, and ``reason`` is the message without that location
    (for callers that report positions in a larger input of their own).
    """

    def __init__(
        self,
        message: str,
        position: int | None = None,
        *,
        line: int | None = None,
        column: int | None = None,
        reason: str | None = None,
    ) -> None:
        # A message that says its line and column does not say its offset too.
        super().__init__(message, position if line is None else None)
        self.position = position
        self.line = line
        self.column = column
        self.reason = message if reason is None else reason


class ParseShort(ParseError):
    """Text ended before the value was complete."""


class ParseEOF(ParseShort):
    """Text held no value at all."""


class LimitExceeded(PreservesError):
    """Input exceeded a configured limit (depth, length or size)."""


class DecodeLimitExceeded(DecodeError, LimitExceeded):
    """Binary input exceeded a configured limit."""


class DecodeTooLarge(DecodeLimitExceeded):
    """A value longer than the decoder's ``max_value_size``."""


class ParseLimitExceeded(ParseError, LimitExceeded):
    """Text input exceeded a configured limit."""
