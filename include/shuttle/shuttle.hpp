// The whole runtime in one include.
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
#include <shuttle/when_all.hpp>
#include <shuttle/when_any.hpp>
