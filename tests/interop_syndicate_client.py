"""A syndicate-py program used by tests/test_interop_syndicate.py (run as a subprocess).

Usage: python interop_syndicate_client.py TRANSPORT STURDYREF NAME

It resolves STURDYREF at TRANSPORT (a Syndicate transport address such as
<tcp "127.0.0.1" 7411>), asserts <Present NAME> and <Secret NAME>, prints presence as it
appears ("+ who") and disappears ("- who"), prints messages <Says who what> ("says who
what"), sends <Says NAME "hello">, and answers each <Ping n> with <Pong NAME n>.
"""

import sys

from syndicate import Record, Symbol, actor, dataspace, parse, relay, turn
from syndicate import patterns as P
from syndicate.schema import sturdy

transport, cap_text, me = sys.argv[1], sys.argv[2], sys.argv[3]
cap = sturdy.SturdyRef.decode(parse(cap_text))


def rec(label, *fields):
    return Record(Symbol(label), list(fields))


def say(*words):
    print(*words, flush=True)


@actor.run_system(name="interop", debug=False, configure_logging=False)
def main():
    @relay.connect(transport, cap)
    def on_connected(ds):
        say("connected")
        turn.publish(ds, rec("Present", me))
        turn.publish(ds, rec("Secret", me))

        @dataspace.during(ds, P.rec("Present", P.CAPTURE))
        def on_presence(who):
            say("+", who)
            turn.on_stop(lambda: say("-", who))

        @dataspace.on_message(ds, P.rec("Says", P.CAPTURE, P.CAPTURE))
        def on_says(who, what):
            say("says", who, what)

        @dataspace.on_message(ds, P.rec("Ping", P.CAPTURE))
        def on_ping(n):
            turn.send(ds, rec("Pong", me, n))

        turn.send(ds, rec("Says", me, "hello"))
