"""Scheduler-side clients: they import no torch and nothing of the daemon."""

from cpcache.client.core import AsyncClient, Client
from cpcache.client.messages import StepResult, attach_request, step_request, step_result
from cpcache.client.outcomes import DecisionLog, HostMirror, Tally
from cpcache.client.session import SchedulerSession
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest

__all__ = ["AsyncClient", "CacheRequests", "Client", "DecisionLog", "HostMirror", "LoadRequest", "PrefetchRequest",
           "SchedulerSession", "StepResult", "Tally", "WriteRequest",
           "attach_request", "step_request", "step_result"]
