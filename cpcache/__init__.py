"""cpcache: a hierarchical KV-cache service whose every decision is agreed by
all ranks of an agreement domain."""

__version__ = "0.1.0"
