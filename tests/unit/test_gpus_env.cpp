// SHUTTLE_GPUS (examples/gpus_env.hpp): which GPU each of two processes
// takes in the GPU tests, benchmarks and shuttle-kv-transfer (issue 33).
#include "../../examples/gpus_env.hpp"

#include <doctest/doctest.h>

using shuttle_gpus::parse;

TEST_CASE("unset or empty: both processes on GPU 0") {
  std::string why = "x";
  auto g = parse(nullptr, 1, why);
  CHECK(why.empty());
  CHECK(g.self == 0);
  CHECK(g.peer == 0);
  CHECK_FALSE(g.peer_named);
  g = parse("", 1, why);
  CHECK(why.empty());
  CHECK(g.self == 0);
}

TEST_CASE("A alone: both on A; A,B: this process on A, the peer on B") {
  std::string why;
  auto g = parse("1", 2, why);
  CHECK(why.empty());
  CHECK(g.self == 1);
  CHECK(g.peer == 1);
  CHECK_FALSE(g.peer_named);
  g = parse("0,1", 2, why);
  CHECK(why.empty());
  CHECK(g.self == 0);
  CHECK(g.peer == 1);
  CHECK(g.peer_named);
  g = parse("1,1", 2, why);
  CHECK(why.empty());
  CHECK(g.peer == 1);
  CHECK(g.peer_named);
}

TEST_CASE("bad values and absent GPUs are refused with a reason") {
  for (const char* v : {"x", "-1", "0,", ",1", "0,1,2", "0;1", "1x", " 1", "0,-1", "99999999999"}) {
    std::string why;
    auto g = parse(v, 8, why);
    CHECK_MESSAGE(why.find("want A or A,B") != std::string::npos, v);
    CHECK(g.self == 0);
    CHECK(g.peer == 0);
  }
  std::string why;
  (void)parse("0,1", 1, why);
  CHECK(why.find("this host has 1 GPU(s)") != std::string::npos);
  (void)parse("2", 2, why);
  CHECK(why.find("this host has 2 GPU(s)") != std::string::npos);
}
