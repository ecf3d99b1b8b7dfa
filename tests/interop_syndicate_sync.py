"""A syndicate-py program for tests/test_interop_syndicate.py (run as a subprocess):
``python interop_syndicate_sync.py TRANSPORT STURDYREF N``.

It resolves STURDYREF, then N times: in one turn asserts <Synced i>, calls
``turn.sync(ds, k)`` and sends <After i>; ``k`` prints "synced i".  syndicate-py 0.19
writes the sync's peer as ``#:#:[0 oid]``, which a server must read as the reference.
"""

import sys

from syndicate import Record, Symbol, actor, parse, relay, turn
from syndicate.schema import sturdy

transport, cap_text, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cap = sturdy.SturdyRef.decode(parse(cap_text))


@actor.run_system(name="interop-sync", debug=False, configure_logging=False)
def main():
    @relay.connect(transport, cap)
    def on_connected(ds):
        def step(i):
            if i == n:
                print("done", flush=True)
                return
            turn.publish(ds, Record(Symbol("Synced"), [i]))

            def k():
                print("synced", i, flush=True)
                step(i + 1)

            turn.sync(ds, k)
            turn.send(ds, Record(Symbol("After"), [i]))

        step(0)
