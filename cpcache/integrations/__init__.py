"""cpcache inside inference servers: each integration runs in the server's
process, speaks to its rank's daemon through `cpcache.client`, and never
imports the daemon's dependencies."""
