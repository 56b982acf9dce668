"""The operation kinds, one module each with its whole lifecycle: how it
opens, what it asks each round, how it takes the agreed answers, all
against the shared `Ledger`."""
