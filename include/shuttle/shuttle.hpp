// The whole runtime in one include: the event loop, tasks and scopes,
// timers, synchronisation, TCP, the transport API (domains, registered
// memory, connections) and the verbs provider's own additions (device
// listing, its error category; these compile without rdma-core).
//
// Two layers stay out because they need optional dependencies to compile:
//  - the CUDA layer, <shuttle/cuda/cuda.hpp> and its siblings: the CUDA
//    toolkit's headers (cuda_runtime_api.h), in a build made with -Dcuda;
//  - Asio interop, <shuttle/asio/asio.hpp>: Boost.Asio's headers.
#pragma once

#include <shuttle/channel.hpp>
#include <shuttle/endpoint.hpp>
#include <shuttle/error.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/receive_stream.hpp>
#include <shuttle/result.hpp>
#include <shuttle/runtime.hpp>
#include <shuttle/scope.hpp>
#include <shuttle/signal.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/task.hpp>
#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/connection_group.hpp>
#include <shuttle/verbs/verbs.hpp>
#include <shuttle/when_all.hpp>
#include <shuttle/when_any.hpp>
