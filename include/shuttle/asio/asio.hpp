// shuttle <-> Boost.Asio interop, everything. See config.hpp for the
// supported Boost range and the include-order rule.
//
//  - async_run.hpp, ops.hpp, transport.hpp: shuttle operations with any Asio
//    completion token (use_awaitable, use_future, callbacks, deferred,
//    as_tuple, ||/&&), Asio cancellation slots -> shuttle cancellation;
//  - use_task.hpp: shuttle tasks await Asio operations;
//  - executor.hpp: the shuttle loop as an Asio execution context;
//  - awaitable.hpp: awaitable<T> and use_awaitable typed on that executor
//    (cheaper per operation than asio::awaitable's any_io_executor);
//  - asio_driver.hpp: an asio::io_context driven from the shuttle loop;
//  - pool.hpp: one io_context run by every loop of a shuttle::runtime;
//  - scheduler_driver.hpp (internal): Asio's scheduler polled from the loop;
//  - recycling.hpp (internal): operation memory (associated allocators, a
//    per-thread cache, Asio's own per-thread cache on shuttle's loop).
//  - sqe_op.hpp (internal): the single-submission operations (read_some,
//    write_some, timers) as direct io_uring operations, async_run's contract
//    without its coroutine frame.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/error.hpp>
#include <shuttle/asio/recycling.hpp>
#include <shuttle/asio/executor.hpp>
#include <shuttle/asio/awaitable.hpp>
#include <shuttle/asio/async_run.hpp>
#include <shuttle/asio/sqe_op.hpp>
#include <shuttle/asio/ops.hpp>
#include <shuttle/asio/transport.hpp>
#include <shuttle/asio/use_task.hpp>
#include <shuttle/asio/asio_driver.hpp>
#include <shuttle/asio/pool.hpp>
