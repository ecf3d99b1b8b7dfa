"""``dataspace demo``: simulated users joining, chatting and leaving an in-process
dataspace, with everything the observers see printed as it happens."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from ..dataspace import Dataspace
from ..values import Record, Symbol, stringify

PRESENT = Symbol("Present")
SAYS = Symbol("Says")

LINES = [
    "hello everyone", "anyone up for lunch?", "the build is green again",
    "I'll review that PR", "brb", "see you tomorrow", "nice work!", "who broke main?",
]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="simulated users chatting in an in-process dataspace",
        description="Simulated users join a chat room (assert <Present name>), talk (send "
        "<Says name text>) and leave (retract); observers print presence appearing and "
        "disappearing and every message.  A late joiner sees the current state at once, "
        "and a producer notices interest in one user's messages.",
    )
    p.add_argument("--users", type=int, default=4, help="number of simulated users (default 4)")
    p.add_argument("--messages", type=int, default=10, help="messages to send in all (default 10)")
    p.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    p.add_argument("--delay", type=float, default=0.0,
                   help="seconds to pause between steps, to watch it live (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.users < 1 or args.messages < 0 or args.delay < 0:
        print("dataspace demo: --users must be >= 1, --messages and --delay >= 0", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    out = sys.stdout
    ds = Dataspace("chat")

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()
        if args.delay:
            time.sleep(args.delay)

    say(f"dataspace demo: {args.users} simulated user{'' if args.users == 1 else 's'} in "
        "one in-process dataspace")
    # The room monitor: presence and messages.
    ds.observe("<Present $who>",
               on_assert=lambda who: say(f"  [room]     + {who} is present"),
               on_retract=lambda who: say(f"  [room]     - {who} left"))
    ds.observe("<Says $who $text>", on_message=lambda who, text: say(f"  [room]     {who}: {text}"))
    # A producer that notices when someone wants to hear one particular user.
    ds.during("<Observe <group <rec Says> {0: <lit $who>}> _>",
              lambda who: say(f"  [producer] someone is listening to {who} now"))

    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    users = [names[i] if i < len(names) else f"user-{i}" for i in range(args.users)]
    handles = {}
    for u in users:
        say(f"{u} joins")
        handles[u] = ds.assert_(Record(PRESENT, [u]))

    # A late joiner sees who is present at once, then follows one user only.
    late = f"late-{users[0]}"
    say(f"{late} joins late and looks around")
    ds.observe("<Present $who>", on_assert=lambda who: say(f"  [{late}] sees {who}"))
    ds.observe(f'<Says "{users[-1]}" $text>', on_message=lambda text: say(f"  [{late}] {users[-1]} said: {text}"))

    for _ in range(args.messages):
        u = rng.choice(users)
        ds.send(Record(SAYS, [u, rng.choice(LINES)]))

    for u in users:
        say(f"{u} leaves")
        ds.retract(handles.pop(u))

    left = [stringify(a) for a in ds.assertions()
            if not (isinstance(a, Record) and a.label == Symbol("Observe"))]
    say(f"done: {len(left)} assertion(s) left besides subscriptions")
    return 0
