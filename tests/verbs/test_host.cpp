// Verbs pieces that must work on any host, with or without an RDMA device.
#include <doctest/doctest.h>

#include <shuttle/io_context.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/verbs/verbs.hpp>

#include <cstdio>

using namespace shuttle;

TEST_CASE("device listing works (and reports 'no RDMA device' when there is none)") {
  auto devs = verbs::list_devices();
  REQUIRE(devs.has_value());
  auto text = verbs::describe_devices();
  std::printf("%s\n", text.c_str());
  if (devs->empty()) CHECK(text == "no RDMA device");
  for (auto& d : *devs) {
    CHECK_FALSE(d.name.empty());
    CHECK_FALSE(d.ports.empty());
  }
}

TEST_CASE("verbs error category: messages and neutral equivalence") {
  auto ec = verbs::make_wc_error(10);  // IBV_WC_REM_ACCESS_ERR
  CHECK(std::string(ec.category().name()) == "verbs");
  CHECK(ec.message() == "remote access error");
  CHECK(shuttle::matches(ec, errc::remote_access_error));
  CHECK(ec == make_error_condition(errc::remote_access_error));
  CHECK(shuttle::matches(verbs::make_wc_error(5), errc::disconnected));    // WR_FLUSH_ERR
  CHECK(shuttle::matches(verbs::make_wc_error(12), errc::disconnected));   // RETRY_EXC_ERR
  CHECK_FALSE(shuttle::matches(verbs::make_wc_error(4), errc::remote_access_error));  // LOC_PROT_ERR
  CHECK(shuttle::matches(make_error_code(errc::disconnected), errc::disconnected));
  CHECK(verbs::make_wc_error(4).message() == "local protection error");
}

TEST_CASE("verbs domain: not_supported without a device, automatic falls back") {
  auto devs = verbs::list_devices();
  if (!devs || !devs->empty()) return;  // a host with a device: covered in the guest
  io_context ctx;  // a domain belongs to a loop (else errc::no_io_context)
  domain_options o;
  o.kind = transport_kind::verbs;
  auto d = domain::open(o);
  REQUIRE_FALSE(d.has_value());
  CHECK(d.error() == make_error_code(errc::not_supported));
}
