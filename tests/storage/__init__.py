"""The storage tier with real processes beside it: writers killed mid-page,
Mooncake Store on a real mooncake_master. The in-process tests of the
backends are in tests/unit/dataplane."""
