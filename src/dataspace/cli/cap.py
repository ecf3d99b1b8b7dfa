"""``dataspace cap``: mint, attenuate, check and show sturdyrefs (capabilities)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..datadir import KEY_BYTES, ROOT_KEY, ROOT_STURDYREF, resolve_data_dir
from ..pattern import PatternError, parse_pattern
from ..protocol.sturdy import (
    SturdyError,
    SturdyRef,
    attenuate,
    attenuation_pattern,
    caveat_kind,
    mint,
    validate,
)
from ..values import PreservesError, Record, Sequence, Symbol, Value, parse, stringify
from ._client import ArgumentError, read_capability_arg
from ._json import to_json
from ._voice import plural

FALLBACK_OID = "root"
"""The root oid of a server with the default configuration (``ServerConfig.root_oid``)."""

EPILOG = """\
examples:
  dataspace cap mint                          the server's root capability,
                                              signed with DATA_DIR/root.key
  dataspace cap mint --oid '"chat"' --key-file chat.key
  dataspace cap attenuate @root.sturdyref --only '<Says "alice" _>'
                                              only <Says "alice" X> may pass
  dataspace cap attenuate @root.sturdyref \\
      --only '<rec Says [<lit "alice"> String]>'
                                              the same, and X must be a string
  dataspace cap attenuate @ref.pr --reject '<rec Observe [<_> <_>]>'
                                              everything except subscriptions
  dataspace cap mint | dataspace cap attenuate - --only '<rec Present [String]>'
  dataspace cap check @ref.pr                 exit 0 if its signature is valid
  dataspace cap show @ref.pr                  the oid and caveats, one per line

REF is Preserves text <ref {oid: ... sig: ...}>, @FILE to read it from a file, or - for
standard input.  A relative FILE not in the current directory is looked for in the data
directory (--data-dir, else $DATASPACE_DATA_DIR ...), so @root.sturdyref is the server's
root ref from anywhere.  Caveats and patterns use the attenuation language of
Syndicate's sturdy.prs: see docs/capabilities.md.
"""

MINT_EPILOG = f"""\
examples:
  dataspace cap mint                          the root ref of DATA_DIR's server
  dataspace cap mint --data-dir ./state       ... of the server run with ./state
  dataspace cap mint --oid '"chat"' --key-hex 00112233...
  dataspace cap mint --oid '"syndicate"' --key-hex ''
                                              the ref of syndicate-py's examples

The default oid is the server's root oid: the oid of DATA_DIR/{ROOT_STURDYREF} (which
the server writes when it starts), else "{FALLBACK_OID}" (the server's default).  So with
no options, mint prints the server's root ref.  --oid takes Preserves text: '"chat"' is
a string, chat a symbol.
"""

ATTENUATE_EPILOG = """\
examples:
  dataspace cap attenuate @root.sturdyref --only '<Says "alice" _>'
  dataspace cap attenuate @ref.pr --only '<rec Says [<lit "alice"> String]>'
  dataspace cap attenuate @ref.pr --only '<rec Present [String]>' \\
      --only '<rec Observe [<_> <_>]>'           either kind may pass
  dataspace cap attenuate @ref.pr --reject '<rec Secret [<_>]>'
  dataspace cap attenuate @ref.pr \\
    '<rewrite <rec Says [<_> <bind String>]> <rec Says [<lit "anon"> <ref 0>]>>'

PATTERN is written in the attenuation language (<rec Says [<lit "alice"> String]>) or
in the concise pattern syntax of observe (<Says "alice" _>, translated with the arity
written: two fields exactly).
--only P adds <rewrite <bind P> <ref 0>> (one flag) or <or [...]> of those (several
flags: a value may match any of them); --reject P adds <reject P>.  Caveats are added in
the order: CAVEAT arguments, then --only, then --reject (the newest run first, so the
--only/--reject filters see what the holder sends before any rewrite).  Patterns match
exact arity: <rec Says [String]> does not match <Says "a" "b">.  Type tests are bare
symbols: String, not <String>.  The attenuated ref is printed; no key is needed.
"""

CHECK_EPILOG = f"""\
examples:
  dataspace cap check @ref.pr                 with DATA_DIR/{ROOT_KEY}
  dataspace cap check @ref.pr --key-file other.key
  dataspace cap check @ref.pr --json          as `show --json`, with "valid"
                                              and "problems"

Exit status: 0 when the signature matches the key and every caveat is valid, 1 when it
does not, 2 when the ref or the key cannot be read.
"""

SHOW_EPILOG = """\
examples:
  dataspace cap show @ref.pr
  dataspace cap show '<ref {oid: "syndicate" sig: #[acowDB2/oI+6aSEC3YIxGg==]}>'
  dataspace cap show @ref.pr --json | jq -r '.caveats[].text'

--json prints one object: {"oid": the oid in JSON (docs/broker.md's mapping), "oid_text":
the oid in Preserves text, "sig": the signature in hexadecimal, "caveats": [{"text",
"kind" (rewrite, or, reject, unknown; null when invalid), "problem" (null, or why the
caveat rejects everything or is invalid)}, ...] oldest first}.
"""


REF_DATA_DIR_HELP = (
    "where to look for @FILE when it is not in the current directory: the data directory "
    "(default: $DATASPACE_DATA_DIR, else $XDG_DATA_HOME/dataspace, else "
    "~/.local/share/dataspace), so that @root.sturdyref is the server's root ref")


class _Fail(Exception):
    """A user error: the message goes to stderr and the exit status is 2."""


def _add_key_options(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--key-hex", metavar="HEX",
                   help="the secret key as hexadecimal digits ('' is the empty key)")
    g.add_argument("--key-file", metavar="PATH", help="read the secret key (raw bytes) from PATH")
    g.add_argument("--data-dir", metavar="DIR",
                   help=f"use DIR/{ROOT_KEY}, the key of the server run with that data "
                   "directory (default: $DATASPACE_DATA_DIR, else $XDG_DATA_HOME/dataspace, else "
                   "~/.local/share/dataspace)")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cap",
        help="mint, attenuate, check and show capabilities (sturdyrefs)",
        description="Capabilities (sturdyrefs) grant access to a dataspace: "
        "<ref {oid: ... sig: ...}>.  Anyone holding one can attenuate it -- add caveats "
        "that filter or rewrite what passes through it -- without the server's key.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=_no_subcommand(p))
    cmds = p.add_subparsers(dest="cap_command", metavar="SUBCOMMAND")

    m = cmds.add_parser(
        "mint", help="make a new capability signed with a secret key",
        description="Make an unattenuated sturdyref for OID, signed with the secret key, "
        "and print it as Preserves text.",
        epilog=MINT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("--oid", metavar="VALUE", default=None,
                   help="the object id, Preserves text (default: the server's root oid)")
    _add_key_options(m)
    m.set_defaults(func=run, cap_func=_mint)

    a = cmds.add_parser(
        "attenuate", help="add caveats to a capability (no key needed)",
        description="Append caveats to REF and print the attenuated ref.",
        epilog=ATTENUATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("ref", metavar="REF", help="the ref: Preserves text, @FILE or -")
    a.add_argument("caveats", metavar="CAVEAT", nargs="*",
                   help="a caveat in Preserves text: <rewrite P T>, <or [...]> or <reject P>")
    a.add_argument("--only", metavar="PATTERN", action="append", default=[],
                   help="only values matching PATTERN pass (repeat for alternatives)")
    a.add_argument("--reject", metavar="PATTERN", action="append", default=[],
                   help="values matching PATTERN are dropped (repeatable)")
    a.add_argument("--allow-unknown", action="store_true",
                   help="accept a CAVEAT of a kind this version does not know (such a "
                   "caveat rejects everything)")
    a.add_argument("--data-dir", metavar="DIR", help=REF_DATA_DIR_HELP)
    a.set_defaults(func=run, cap_func=_attenuate)

    c = cmds.add_parser(
        "check", help="check a capability's signature against a key",
        description="Say whether REF's signature matches the secret key, and list its "
        "caveats.",
        epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("ref", metavar="REF", help="the ref: Preserves text, @FILE or -")
    c.add_argument("--json", action="store_true",
                   help="print one JSON object (as show --json, with \"valid\" and "
                   "\"problems\")")
    _add_key_options(c)
    c.set_defaults(func=run, cap_func=_check)

    s = cmds.add_parser(
        "show", help="print a capability's oid and caveats",
        description="Pretty-print REF: its oid, signature and caveats (no key needed; "
        "use `check` to verify the signature).",
        epilog=SHOW_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("ref", metavar="REF", help="the ref: Preserves text, @FILE or -")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: {\"oid\", \"oid_text\", \"sig\", "
                   "\"caveats\"}")
    s.add_argument("--data-dir", metavar="DIR", help=REF_DATA_DIR_HELP)
    s.set_defaults(func=run, cap_func=_show)


def _no_subcommand(p: argparse.ArgumentParser) -> Any:
    def run_help(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        print("\ndataspace cap: choose a subcommand: mint, attenuate, check or show",
              file=sys.stderr)
        return 2

    return run_help


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.cap_func(args))
    except _Fail as e:
        print(f"dataspace cap {args.cap_command}: {e}", file=sys.stderr)
        return 2
    except SturdyError as e:
        print(f"dataspace cap {args.cap_command}: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------
# Reading input


def _read_ref(arg: str, args: argparse.Namespace) -> SturdyRef:
    try:
        return read_capability_arg(arg, stdin=True, data_dir=getattr(args, "data_dir", None))
    except ArgumentError as e:
        raise _Fail(str(e)) from None


def _parse_value(text: str, what: str) -> Value:
    try:
        return parse(text, max_length=1 << 20)
    except PreservesError as e:
        raise _Fail(f"{what} is not valid Preserves text: {e}") from None


def _data_dir(args: argparse.Namespace) -> Path:
    try:
        return resolve_data_dir(getattr(args, "data_dir", None), create=False)
    except OSError as e:
        raise _Fail(str(e)) from None


def _root_oid(args: argparse.Namespace) -> Value:
    """The server's root oid: from DATA_DIR/root.sturdyref if there is one."""
    path = _data_dir(args) / ROOT_STURDYREF
    try:
        return SturdyRef.parse(path.read_text(encoding="utf-8")).oid
    except FileNotFoundError:
        return FALLBACK_OID
    except (OSError, UnicodeDecodeError, SturdyError) as e:
        raise _Fail(f"cannot take the default oid from {path}: {e}; pass --oid") from None


def _load_key(args: argparse.Namespace) -> bytes:
    if args.key_hex is not None:
        h = args.key_hex.strip()
        if h.startswith(('#x"', "#x'")) and h.endswith(('"', "'")):
            h = h[3:-1]
        try:
            return bytes.fromhex(h)
        except ValueError:
            raise _Fail(
                f"--key-hex must be hexadecimal digits (two per byte), not {args.key_hex!r}"
            ) from None
    if args.key_file is not None:
        path = Path(args.key_file).expanduser()
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise _Fail(f"the key file {path} does not exist") from None
        except OSError as e:
            raise _Fail(f"cannot read the key file {path}: {e.strerror}") from None
    path = _data_dir(args) / ROOT_KEY
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        raise _Fail(
            f"no key: {path} does not exist.  The server creates it when it first starts: "
            f"run `dataspace serve{' --data-dir ' + str(args.data_dir) if args.data_dir else ''}` "
            "once, or pass --key-hex HEX or --key-file PATH"
        ) from None
    except OSError as e:
        raise _Fail(f"cannot read the key {path}: {e.strerror}") from None
    if len(key) != KEY_BYTES:
        raise _Fail(
            f"{path} is not a dataspace key ({plural(len(key), 'byte')}, expected {KEY_BYTES}); "
            "use --key-file for a key of another length"
        )
    return key


# ---------------------------------------------------------------------------------------
# Subcommands


def _mint(args: argparse.Namespace) -> int:
    oid: Value = _root_oid(args) if args.oid is None else _parse_value(args.oid, "--oid")
    key = _load_key(args)
    print(mint(oid, key))
    return 0


def _checked(caveat: Value, what: str, allow_unknown: bool) -> Value:
    try:
        kind, why = caveat_kind(caveat)
    except SturdyError as e:
        raise _Fail(f"{what}: {e}") from None
    if kind == "unknown" and not allow_unknown:
        raise _Fail(
            f"{what} would reject everything, because it is not a caveat this version "
            f"understands: {why} (pass --allow-unknown if that is what you want)"
        )
    return caveat


_ATTENUATION_WORDS = frozenset({"_", "bind", "and", "not", "lit", "rec", "arr", "dict"})


def _pattern_caveat(flag: str, text: str, make: Any) -> Value:
    """The caveat ``make(pattern)`` for ``--only``/``--reject PATTERN``, checked.

    PATTERN is either in the attenuation language (``<rec Says [<lit "alice"> String]>``)
    or in the concise dataspace syntax (``<Says "alice" _>``), translated with the arity
    written; the attenuation reading wins when both apply.
    """
    pv = _parse_value(text, f"the PATTERN of {flag}")
    c = make(pv)
    try:
        kind, why = caveat_kind(c)
    except SturdyError as e:  # pragma: no cover - these caveats have no templates to get wrong
        raise _Fail(f"{flag} {text}: {e}") from None
    if kind != "unknown":
        return c
    if type(pv) is Record and type(pv.label) is Symbol and pv.label.name in _ATTENUATION_WORDS:
        # Meant as the attenuation language: teach rather than reinterpret it.
        raise _Fail(f"{flag} {text}: not a pattern of the attenuation language: {why}")
    try:
        concise = parse_pattern(text)
    except PatternError:
        raise _Fail(
            f"{flag} {text}: neither an attenuation pattern ({why}) nor a pattern in the "
            "concise syntax such as <Says \"alice\" _>"
        ) from None
    return make(attenuation_pattern(concise))


def _only(p: Value) -> Value:
    return Record(Symbol("rewrite"), [Record(Symbol("bind"), [p]), Record(Symbol("ref"), [0])])


def _reject(p: Value) -> Value:
    return Record(Symbol("reject"), [p])


def _attenuate(args: argparse.Namespace) -> int:
    ref = _read_ref(args.ref, args)
    new: list[Value] = []
    for i, text in enumerate(args.caveats, 1):
        c = _parse_value(text, f"CAVEAT {i}")
        new.append(_checked(c, f"CAVEAT {i} ({text})", args.allow_unknown))
    rewrites = [_pattern_caveat("--only", text, _only) for text in args.only]
    if len(rewrites) == 1:
        new.append(rewrites[0])
    elif rewrites:
        new.append(Record(Symbol("or"), [Sequence(rewrites)]))
    new.extend(_pattern_caveat("--reject", text, _reject) for text in args.reject)
    if not new:
        raise _Fail("nothing to add: give CAVEAT arguments, --only PATTERN or --reject PATTERN")
    print(attenuate(ref, *new))
    return 0


def _describe_caveats(ref: SturdyRef) -> tuple[list[str], list[str]]:
    """Lines describing each caveat, and the problems that make the ref unusable."""
    lines: list[str] = []
    problems: list[str] = []
    n = len(ref.caveats)
    if not n:
        lines.append("caveats: none (full access to the object)")
        return lines, problems
    lines.append(f"caveats: {n}, applied newest (last) first")
    for i, c in enumerate(ref.caveats, 1):
        text = stringify(c, indent=2).replace("\n", "\n     ")
        try:
            kind, why = caveat_kind(c)
        except SturdyError as e:
            lines.append(f"  {i}. {text}")
            lines.append(f"     INVALID: {e}")
            problems.append(f"caveat {i} is invalid")
            continue
        lines.append(f"  {i}. {text}")
        if kind == "unknown":
            lines.append(f"     unknown kind: it rejects everything ({why})")
    return lines, problems


def _as_json(ref: SturdyRef) -> dict[str, Any]:
    """``show --json``: the ref's oid, signature and caveats (see SHOW_EPILOG)."""
    caveats = []
    for c in ref.caveats:
        try:
            kind, why = caveat_kind(c)
            problem = f"unknown kind: it rejects everything ({why})" if kind == "unknown" else None
        except SturdyError as e:
            kind, problem = None, f"invalid: {e}"
        caveats.append({"text": stringify(c), "kind": kind, "problem": problem})
    return {"oid": to_json(ref.oid), "oid_text": stringify(ref.oid), "sig": ref.sig.hex(),
            "caveats": caveats}


def _check(args: argparse.Namespace) -> int:
    ref = _read_ref(args.ref, args)
    key = _load_key(args)
    ok = validate(ref, key)
    lines, problems = _describe_caveats(ref)
    if args.json:
        doc = _as_json(ref)
        doc["valid"] = ok and not problems
        doc["signature_valid"] = ok
        doc["problems"] = problems
        print(json.dumps(doc, ensure_ascii=False))
        return 0 if ok and not problems else 1
    if ok and not problems:
        print("valid: the signature matches the key")
    elif ok:
        print(f"INVALID: the signature matches the key, but {', '.join(problems)}: "
              "the server will refuse this ref")
    else:
        print("INVALID: the signature does not match the key (a different key, or the ref "
              "was altered after signing)")
    print(f"oid: {stringify(ref.oid)}")
    for line in lines:
        print(line)
    return 0 if ok and not problems else 1


def _show(args: argparse.Namespace) -> int:
    ref = _read_ref(args.ref, args)
    if args.json:
        print(json.dumps(_as_json(ref), ensure_ascii=False))
        return 0
    print(f"oid: {stringify(ref.oid)}")
    print(f"sig: {ref.sig.hex()}")
    lines, _problems = _describe_caveats(ref)
    for line in lines:
        print(line)
    return 0
