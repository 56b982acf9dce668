"""The fast set: in-process tests, one folder per package folder of
`cpcache/`. No daemon or server process is started here (a few tests run a
short child process of their own: a CLI command, a process out of
descriptors); `pytest tests/unit` runs alone in about half a minute."""
