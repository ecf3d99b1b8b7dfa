"""A syndicate-py worker in a group, used by tests/test_groups_interop.py (a subprocess).

Usage: python interop_syndicate_group.py TRANSPORT STURDYREF GROUP NAME

It resolves STURDYREF at TRANSPORT and joins GROUP as an observer of <Job $id> by
asserting the documented record <ObserveGroup GROUP PATTERN #:observer> (docs/broker.md,
"Sharing work"): it prints "joined", then "! ID" for each message given to it, "+ ID"
for each job assigned to it and "- ID" when that job goes; for each job it sends
<Done ID NAME>.
"""

import sys

from preserves import Embedded
from syndicate import Record, Symbol, actor, parse, relay, turn
from syndicate import patterns as P
from syndicate.during import Handler
from syndicate.schema import sturdy

transport, cap_text, group, me = sys.argv[1:5]
cap = sturdy.SturdyRef.decode(parse(cap_text))


def say(*words):
    print(*words, flush=True)


@actor.run_system(name="interop-group", debug=False, configure_logging=False)
def main():
    @relay.connect(transport, cap)
    def on_connected(ds):
        def on_job(job_id):
            say("+", job_id)
            turn.send(ds, Record(Symbol("Done"), [job_id, me]))
            return lambda: say("-", job_id)

        def on_message(job_id):
            say("!", job_id)

        worker = Handler(on_add=on_job, on_msg=on_message)
        turn.publish(ds, Record(Symbol("ObserveGroup"),
                                [group, P.rec("Job", P.CAPTURE), Embedded(turn.ref(worker))]))
        say("joined")
