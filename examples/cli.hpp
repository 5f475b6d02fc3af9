// Command-line parsing shared by the example programs: an option table,
// numeric values with clear errors, and the --transport names.
//
//   cli::parser p{"shuttle-echo-client", usage_text};
//   p.parse(argc, argv, {
//       {"--port", [&](std::string_view v) { o.port = p.count("--port", v, 1, 65535); }},
//       {"--json", [&] { o.json = true; }},
//   });
//
// Options take their value as `--name VALUE` or `--name=VALUE`; flags take
// none. -h/--help prints the usage on stdout and exits 0. Every error prints
// "PROG: what went wrong" on stderr and exits 2.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <system_error>
#include <variant>

#include <shuttle/transport.hpp>

namespace cli {

// The transports an example can run over. `socket`: plain TCP sockets (the
// echo programs' original mode); the others go through the transport API.
enum class transport { socket, rdma, tcp_provider, automatic };

inline const char* to_string(transport t) noexcept {
  switch (t) {
    case transport::socket: return "tcp";
    case transport::rdma: return "rdma";
    case transport::tcp_provider: return "tcp-provider";
    case transport::automatic: return "auto";
  }
  return "?";
}

// The provider a transport-API mode asks domain::open for.
inline shuttle::transport_kind kind_of(transport t) noexcept {
  switch (t) {
    case transport::rdma: return shuttle::transport_kind::verbs;
    case transport::tcp_provider: return shuttle::transport_kind::tcp;
    default: return shuttle::transport_kind::automatic;
  }
}

// The name of what domain::open picked, in --transport terms.
inline const char* name_of(shuttle::transport_kind k) noexcept {
  switch (k) {
    case shuttle::transport_kind::verbs: return "rdma";
    case shuttle::transport_kind::tcp: return "tcp-provider";
    default: return "auto";
  }
}

struct option {
  using value_fn = std::function<void(std::string_view value)>;
  using flag_fn = std::function<void()>;
  option(std::string_view n, value_fn f) : name(n), apply(std::move(f)) {}
  option(std::string_view n, flag_fn f) : name(n), apply(std::move(f)) {}
  std::string_view name;                     // "--port"
  std::variant<value_fn, flag_fn> apply;     // a value_fn takes a value, a flag_fn none
};

class parser {
 public:
  parser(const char* prog, std::string usage) : prog_(prog), usage_(std::move(usage)) {}

  const char* prog() const noexcept { return prog_; }

  // Prints the usage (stdout for 0, stderr otherwise) and exits with `code`.
  [[noreturn]] void usage(int code) const {
    std::fputs(usage_.c_str(), code ? stderr : stdout);
    std::exit(code);
  }

  // "PROG: message", exit 2.
  [[noreturn]] void fail(const std::string& message) const {
    std::fprintf(stderr, "%s: %s\n", prog_, message.c_str());
    std::exit(2);
  }

  // "PROG: message", the usage, exit 2.
  [[noreturn]] void fail_with_usage(const std::string& message) const {
    std::fprintf(stderr, "%s: %s\n", prog_, message.c_str());
    usage(2);
  }

  [[noreturn]] void bad_value(std::string_view name, std::string_view value, std::string_view expected) const {
    fail("bad " + std::string(name) + " '" + std::string(value) + "' (" + std::string(expected) + ")");
  }

  // A decimal integer in [min, max].
  std::uint64_t count(std::string_view name, std::string_view s, std::uint64_t min, std::uint64_t max) const {
    std::uint64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc{} || end != s.data() + s.size() || v < min || v > max)
      bad_value(name, s, std::to_string(min) + "-" + std::to_string(max));
    return v;
  }

  // A byte count in [min, max]: decimal, optionally followed by k, m or g
  // (KiB, MiB, GiB; either case).
  std::uint64_t bytes(std::string_view name, std::string_view s, std::uint64_t min, std::uint64_t max) const {
    std::uint64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    const std::string expected = std::to_string(min) + "-" + std::to_string(max) + " bytes; suffixes k, m, g";
    if (s.empty() || ec != std::errc{}) bad_value(name, s, expected);
    std::string_view rest(end, static_cast<std::size_t>(s.data() + s.size() - end));
    unsigned shift = 0;
    if (rest == "k" || rest == "K")
      shift = 10;
    else if (rest == "m" || rest == "M")
      shift = 20;
    else if (rest == "g" || rest == "G")
      shift = 30;
    else if (!rest.empty())
      bad_value(name, s, expected);
    if (v > (UINT64_MAX >> shift)) bad_value(name, s, expected);
    v <<= shift;
    if (v < min || v > max) bad_value(name, s, expected);
    return v;
  }

  // Seconds, > 0, fractions allowed.
  double seconds(std::string_view name, std::string_view s) const {
    std::string str(s);
    char* end = nullptr;
    double v = std::strtod(str.c_str(), &end);
    if (str.empty() || *end != '\0' || !std::isfinite(v) || v <= 0 || v > 1e6) bad_value(name, s, "seconds, > 0");
    return v;
  }

  // One of the names in `allowed` ("tcp", "rdma", "tcp-provider", "auto";
  // "verbs" is taken for "rdma").
  transport transport_name(std::string_view name, std::string_view s,
                           std::initializer_list<transport> allowed) const {
    transport t;
    if (s == "tcp")
      t = transport::socket;
    else if (s == "rdma" || s == "verbs")
      t = transport::rdma;
    else if (s == "tcp-provider")
      t = transport::tcp_provider;
    else if (s == "auto")
      t = transport::automatic;
    else
      t = static_cast<transport>(-1);
    std::string names;
    for (transport a : allowed) {
      if (a == t) return t;
      names += (names.empty() ? "" : ", ") + std::string(to_string(a));
    }
    bad_value(name, s, names);
  }

  // Applies `table` to argv[1..]. Unknown options and missing values are
  // errors; -h/--help prints the usage.
  void parse(int argc, char** argv, std::initializer_list<option> table) const {
    for (int i = 1; i < argc; ++i) {
      std::string_view arg = argv[i];
      if (arg == "-h" || arg == "--help") usage(0);
      std::string_view name = arg, value;
      bool inline_value = false;
      if (auto eq = arg.find('='); arg.starts_with("--") && eq != arg.npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
        inline_value = true;
      }
      const option* opt = nullptr;
      for (const option& o : table)
        if (o.name == name) opt = &o;
      if (!opt) fail_with_usage("unknown option '" + std::string(name) + "'");
      if (auto* flag = std::get_if<option::flag_fn>(&opt->apply)) {
        if (inline_value) fail(std::string(name) + " takes no value");
        (*flag)();
        continue;
      }
      if (!inline_value) {
        if (i + 1 >= argc) fail_with_usage(std::string(name) + " needs a value");
        value = argv[++i];
      }
      std::get<option::value_fn>(opt->apply)(value);
    }
  }

 private:
  const char* prog_;
  std::string usage_;
};

}  // namespace cli
