"""Scheduler-side clients: they import no torch and nothing of the daemon."""

from cpcache.client.core import AsyncClient, Client, Ops, StepResult, attach_request, step_request, step_result

__all__ = ["AsyncClient", "Client", "Ops", "StepResult", "attach_request", "step_request", "step_result"]
