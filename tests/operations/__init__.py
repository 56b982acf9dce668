"""What an operator runs: the systemd units, compose.yaml, the Dockerfile,
sd_notify and metrics of a real daemon, the resource budget as the unit and
docs/security.md state it, the GPU driver's run.sh."""
