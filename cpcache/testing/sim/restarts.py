"""The restarts a replay can go through (`ReplayConfig.restart`), kept apart
from the replay itself so the command line can list them without loading
torch."""

RESTARTS = ("none", "schedulers", "daemon-kill", "daemon-stop")
