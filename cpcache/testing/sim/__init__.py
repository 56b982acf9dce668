"""Trace replay: a scheduler simulator that drives a local domain."""
