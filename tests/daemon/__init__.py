"""One real daemon in a process of its own: cpcached started as an operator
starts it (listeners, signals, trust boundaries, floods), or the rendezvous
store the agreement's bounds are tried against."""
