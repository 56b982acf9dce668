"""cpcached: the gRPC servicer, the server lifecycle and the entry point."""
