"""Shared by the client commands (observe, assert, send, query, request): options,
connecting, signals, and what a capability's caveats do to what the command sends."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from ..client import (
    CapabilityError,
    CapabilityMissing,
    CapabilityRejected,
    RemoteDataspace,
    connect,
    default_address,
)
from ..datadir import resolve_data_dir
from ..dataspace import OBSERVE, Entity
from ..net.address import DEFAULT_HOST, DEFAULT_PORT
from ..net.tls import TLSConfigError
from ..pattern import Pattern, to_preserves
from ..protocol.sturdy import Attenuation, SturdyError, SturdyRef
from ..values import Embedded, ParseError, Record, Symbol, Value, key, parse, stringify

CONNECTION_HELP = f"""\
connecting:
  By default the command connects to $DATASPACE_SERVER or {DEFAULT_HOST}:{DEFAULT_PORT} with the
  capability in the data directory's root.sturdyref (written by `dataspace serve`).  Use
  --server for another address (HOST:PORT, tls://HOST:PORT, unix:PATH, ws://HOST:PORT/,
  wss://HOST:PORT/; several, separated by commas, for the members of a cluster: the command
  fails over between them) and --cap for another capability (Preserves text, e.g. from
  `dataspace cap`, or @FILE: a relative FILE is looked for here, then in the data
  directory).  Over tls:// and wss:// the server's certificate is checked against --tls-ca
  (default $DATASPACE_TLS_CA, else the system's trust store) and its name.  --name is what
  `dataspace top` and the inspector call this client (default: the command, e.g.
  "dataspace observe").
"""


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="ADDRESS[,ADDRESS...]", default=None,
                   help=f"server address, or a cluster's members separated by commas (default "
                   f"$DATASPACE_SERVER or {DEFAULT_HOST}:{DEFAULT_PORT})")
    p.add_argument("--cap", metavar="STURDYREF", default=None,
                   help="capability as Preserves text, or @FILE to read it from a file "
                   "(default: <data-dir>/root.sturdyref)")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="data directory holding root.sturdyref (default: $DATASPACE_DATA_DIR, else "
                   "$XDG_DATA_HOME/dataspace, else ~/.local/share/dataspace)")
    p.add_argument("--name", metavar="NAME", default=None,
                   help="what the server's monitoring (`dataspace top`, the inspector) calls "
                   "this client (default: the command, e.g. \"dataspace observe\")")
    add_tls_args(p)


def add_tls_args(p: argparse.ArgumentParser, what: str = "tls:// and wss:// servers",
                 server_name: bool = True) -> None:
    """The TLS options of a client command (``--tls-ca`` and friends)."""
    g = p.add_argument_group("TLS (docs/security.md)")
    g.add_argument("--tls-ca", metavar="FILE", default=None,
                   help=f"the CA to trust for {what} (default $DATASPACE_TLS_CA, else the "
                   "system's trust store)")
    g.add_argument("--tls-cert", metavar="FILE", default=None,
                   help="a client certificate, for servers that ask for one (mutual TLS; "
                   "default $DATASPACE_TLS_CERT)")
    g.add_argument("--tls-key", metavar="FILE", default=None,
                   help="the key of --tls-cert (default $DATASPACE_TLS_KEY)")
    if server_name:
        g.add_argument("--tls-server-name", metavar="NAME", default=None,
                       help="the name the server's certificate must have (default: the host "
                       "connected to)")
    g.add_argument("--tls-insecure-skip-verify", action="store_true",
                   help="INSECURE: accept any certificate for any name; whoever answers "
                   "(a man in the middle) gets the capability sent")


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """The TLS options given on the command line, as :func:`~dataspace.client.connect`'s
    keyword arguments (only those given)."""
    out: dict[str, Any] = {}
    for name in ("tls_ca", "tls_cert", "tls_key", "tls_server_name"):
        v = getattr(args, name, None)
        if v:
            out[name] = v
    if getattr(args, "tls_insecure_skip_verify", False):
        out["tls_insecure_skip_verify"] = True
    return out


class ArgumentError(ValueError):
    """A command-line argument that cannot be used; the message says why (for stderr)."""


def read_text_arg(arg: str, what: str, *, stdin: bool = False,
                  data_dir: str | Path | bool | None = False) -> str:
    """A textual argument as the user gave it: the text itself, ``@FILE`` for the
    contents of FILE, or (when ``stdin``) ``-`` for standard input.

    Unless ``data_dir`` is False, a relative FILE that is not in the current directory
    is looked for in the data directory too (``data_dir``: the one given, or None for
    the default), where the server writes ``root.sturdyref``."""
    if stdin and arg == "-":
        return sys.stdin.read()
    if not arg.startswith("@"):
        return arg
    path = Path(arg[1:]).expanduser()
    if data_dir is not False and not path.is_absolute() and not path.exists():
        try:
            where = resolve_data_dir(data_dir or None, create=False)  # type: ignore[arg-type]
        except OSError:
            where = None
        if where is not None and (where / path).exists():
            path = where / path
        else:
            raise ArgumentError(
                f"cannot read the {what}: no file {path} here ({Path.cwd()}) or in the data "
                f"directory {where}; give its path (@/path/to/{path.name}), or the server's "
                "data directory with --data-dir DIR")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArgumentError(f"cannot read the {what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"cannot read the {what} from {path}: {e}") from None


def read_capability_arg(arg: str, *, stdin: bool = False,
                        data_dir: str | Path | bool | None = False) -> SturdyRef:
    """A capability argument (``--cap``, ``dataspace cap``'s REF): Preserves text
    ``<ref {...}>``, ``@FILE`` (see :func:`read_text_arg` for ``data_dir``), or (when
    ``stdin``) ``-``."""
    text = read_text_arg(arg, "ref", stdin=stdin, data_dir=data_dir)
    try:
        return SturdyRef.parse(text)
    except SturdyError as e:
        hint = ""
        if not arg.startswith(("@", "-")) and not text.lstrip().startswith("<") and Path(arg).exists():
            hint = f" (to read the ref from the file {arg}, write @{arg})"
        raise ArgumentError(f"{e}{hint}") from None


async def open_dataspace(prog: str, args: argparse.Namespace) -> RemoteDataspace | None:
    """Connect as the options say, or print what went wrong (and what to do) and return
    None."""
    try:
        cap = None if args.cap is None else read_capability_arg(args.cap, data_dir=args.data_dir)
        return await connect(args.server or default_address(), cap, data_dir=args.data_dir,
                             name=args.name if args.name is not None else prog,
                             **tls_options(args))
    except ArgumentError as e:
        print(f"{prog}: --cap: {e}", file=sys.stderr)
    except CapabilityRejected as e:
        print(f"{prog}: {e}; is this the capability of that server? (--cap, --data-dir)",
              file=sys.stderr)
    except CapabilityMissing as e:
        print(f"{prog}: no capability: {e.path} does not exist; start the server with "
              "`dataspace serve` (it writes that file), or pass --data-dir DIR (the "
              "server's) or --cap STURDYREF (or @FILE)", file=sys.stderr)
    except CapabilityError as e:
        print(f"{prog}: {e}", file=sys.stderr)
    except TLSConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
    except (ConnectionError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
    return None


def parse_value(prog: str, text: str) -> Value | None:
    try:
        return parse(text)
    except ParseError as e:
        print(
            f"{prog}: cannot read {text!r} as a value: {e}\n"
            f"  values are Preserves text, e.g. '<Says \"alice\" \"hi\">' (quote it for your shell)",
            file=sys.stderr,
        )
        return None


def stop_event() -> asyncio.Event:
    """An event set by Ctrl-C (SIGINT) or SIGTERM."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev


def formatter() -> Any:
    return argparse.RawDescriptionHelpFormatter


# ---------------------------------------------------------------------------------------
# What the capability's caveats do (known locally: the server applies the same ones)


class _Probe(Entity):
    """Stands for this client's observer in a subscription checked against caveats."""


def through_caveats(ds: RemoteDataspace, value: Value) -> Value | None:
    """``value`` as the server will receive it through this client's capability: None
    when the caveats drop it, else the value (rewritten if a caveat rewrites it)."""
    caveats = ds.cap.caveats
    if not caveats:
        return value
    return Attenuation(caveats).apply(value)


def subscription_through_caveats(ds: RemoteDataspace, pattern: Pattern) -> tuple[Value, Value | None]:
    """The subscription ``<Observe PATTERN #:observer>`` that observing ``pattern``
    asserts, and what the capability's caveats make of it (None: dropped)."""
    sub = Record._make(OBSERVE, (to_preserves(pattern), Embedded(_Probe())))
    return sub, through_caveats(ds, sub)


def _text(v: Value) -> str:
    s = stringify(v, embedded=lambda obj: Symbol("observer"))
    return s if len(s) <= 200 else s[:197] + "..."


def warn_dropped(prog: str, ds: RemoteDataspace, value: Value, *, what: str) -> bool:
    """Say (one line on stderr) what the caveats of the capability do to ``value`` (an
    assertion or message: ``what``); True if they drop it."""
    out = through_caveats(ds, value)
    if out is None:
        print(f"{prog}: the capability's caveats drop {_text(value)}: the server will "
              f"ignore this {what} (see `dataspace cap show` for the caveats)", file=sys.stderr)
        return True
    if key(out) != key(value):
        print(f"{prog}: the capability's caveats rewrite {_text(value)} to {_text(out)}",
              file=sys.stderr)
    return False


def check_subscription(prog: str, ds: RemoteDataspace, pattern: Pattern) -> bool:
    """Whether the capability lets this client observe ``pattern``; if not, say so (one
    line on stderr: nothing could ever match)."""
    sub, out = subscription_through_caveats(ds, pattern)
    if out is None:
        print(f"{prog}: the capability's caveats drop the subscription {_text(sub)}: "
              "nothing can match (use a capability that allows <Observe ...>, e.g. one "
              "attenuated with --only '<rec Observe [<_> <_>]>')", file=sys.stderr)
        return False
    return True
