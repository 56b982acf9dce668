"""Exhaustive small-scope model checking of the epoch / Attach / fencing
protocol (docs/design.md §11).

- `attach_model`: Attach over its own code (`cpcache.agreement.attach`,
  driven step by step over an in-memory store with TCPStore's semantics):
  every program of 2 ranks x up to 2 attaches and 3 ranks x 1 attach, each
  of descriptor A or B, in every order of publishing, looking and deadlines
  passing, then docs/protocol.md's remedy (attach again everywhere) from every end
  state. Mutations: descriptors that outlive their attempt, a deadline
  decided locally.
- `fencing_model`: one rank leaving its epoch while a round is in its
  collective and a load is queued, against a peer that enters late or never;
  mirrors the engine, stepper, movers and detach. Mutations: a round applied
  after the leave, jobs reading the pool when they run and a timed drain,
  the close sentinel eaten (the other half of a round applied late).

`pytest tests/model -s` prints the states explored and the run time.
"""
