"""The daemon's gRPC servers: the CacheDaemon service, the standard health
service and reflection, under the daemon's message and concurrency limits.
One server per listener (`listeners`), all alike."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cpcache.config import DaemonConfig
from cpcache.daemon import budget
from cpcache.daemon.call_limits import CallCounts, CallLimits, grpc_limit
from cpcache.daemon.call_limits import grpc_options as limit_options
from cpcache.daemon.servicer import CacheDaemonServicer
from cpcache.daemon.status import tolerant
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import MAX_MESSAGE_BYTES

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheDaemon"].full_name


def service_handler(servicer: CacheDaemonServicer) -> grpc.GenericRpcHandler:
    """The CacheDaemon service, as the generated code registers it, except
    that a request body that does not decode reaches the handler (and is
    answered INVALID_ARGUMENT) instead of escaping as UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["CacheDaemon"]
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        reply_class = message_factory.GetMessageClass(method.output_type)
        kind = (grpc.stream_stream_rpc_method_handler if method.client_streaming and method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=tolerant(request_class.FromString),
            response_serializer=reply_class.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def new_server(config: DaemonConfig, servicer: CacheDaemonServicer, health: health_async.HealthServicer,
               metrics: grpc.aio.ServerInterceptor, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               options: Sequence[tuple[str, int]] = (), calls: CallCounts | None = None) -> grpc.aio.Server:
    """A server of the daemon's services, not yet bound (`listeners` binds it),
    with its own shares of calls (`call_limits`), counted into `calls`."""
    # The metrics interceptor comes first, so refused calls are counted too;
    # the shares come last, so a call the token refuses takes no slot. Past
    # a share the call is answered RESOURCE_EXHAUSTED, naming the setting;
    # gRPC's own limit is a backstop above every share.
    # Twice the message limit: a request between the two gets a clear
    # INVALID_ARGUMENT from the handler (`status.tolerant`) rather than
    # gRPC's own RESOURCE_EXHAUSTED, which also means "pool full" here.
    limits = [("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
              ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
              *budget.grpc_options(), *limit_options(config)]
    server = grpc.aio.server(interceptors=[metrics, *interceptors, CallLimits(config, calls)],
                             options=[*limits, *options], maximum_concurrent_rpcs=grpc_limit(config))
    server.add_generic_rpc_handlers((service_handler(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # Reflection: grpcurl and friends list and call the API without the proto.
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    return server


async def set_health(health: health_async.HealthServicer, serving: bool) -> None:
    """The overall status and the CacheDaemon service's, alike."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        await health.set(service, status)
