"""Scheduler-side clients: they import no torch and nothing of the daemon."""

from cpcache.client.core import AsyncClient, Client
from cpcache.client.messages import Ops, StepResult, attach_request, step_request, step_result
from cpcache.client.outcomes import DecisionLog, HostMirror, Tally
from cpcache.client.session import SchedulerSession

__all__ = ["AsyncClient", "Client", "DecisionLog", "HostMirror", "Ops", "SchedulerSession", "StepResult", "Tally",
           "attach_request", "step_request", "step_result"]
