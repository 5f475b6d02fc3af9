// What the example programs share on their command lines, on top of CLI11
// (Debian's libcli11-dev): the same --help, --version and exit statuses in
// every tool, value checks with clear messages, and the --transport names.
//
//   CLI::App app{"Echoes what clients send.", "shuttle-echo-server"};
//   cli::setup(app, "shuttle-echo-server --port P [--threads N]");
//   app.add_option("--port", o.port, "port to listen on")->required()->check(cli::count(0, 65535));
//   app.add_flag("--json", o.json, "...");
//   cli::parse(app, argc, argv);
//   if (conflict) cli::fail(app, "--a and --b exclude each other");
//
// Options take their value as `--name VALUE` or `--name=VALUE`; given twice,
// the last one counts. -h/--help prints the help on stdout and exits 0;
// --version prints "PROG VERSION" and exits 0. Every usage error prints
// "PROG: what went wrong", the synopsis and a pointer to --help on stderr
// and exits 2.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <shuttle/transport.hpp>

#include "shuttle_version.h"  // SHUTTLE_VERSION: meson's project version

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
    case shuttle::transport_kind::local: return "local";
    default: return "auto";
  }
}

// The help's usage line is the tool's own synopsis ("usage: PROG --port P
// [...]"), which says more than CLI11's generic "PROG [OPTIONS]".
class formatter : public CLI::Formatter {
 public:
  explicit formatter(std::string synopsis) : synopsis_(std::move(synopsis)) {}
  std::string make_usage(const CLI::App*, std::string) const override { return synopsis_; }
  // CLI11 2.1 prints a description on one line, however long: wrapped here
  // to fit 100 columns beside the option column.
  std::string make_option_desc(const CLI::Option* opt) const override {
    return wrap(CLI::Formatter::make_option_desc(opt), 100 - get_column_width());
  }
  const std::string& synopsis() const noexcept { return synopsis_; }

 private:
  static std::string wrap(const std::string& text, std::size_t width) {
    std::string out, line;
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.find(' ', start);
      if (end == std::string::npos) end = text.size();
      const std::string word = text.substr(start, end - start);
      if (!line.empty() && line.size() + 1 + word.size() > width) {
        out += line + "\n";
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
      start = end + 1;
    }
    return out + line;
  }

  std::string synopsis_;
};

// "PROG: message", the synopsis, a pointer to --help.
inline std::string failure_text(const CLI::App& app, const std::string& message) {
  std::string text = app.get_name() + ": " + message + "\n";
  if (auto f = std::dynamic_pointer_cast<formatter>(app.get_formatter())) text += f->synopsis();
  return text + "Run with --help for more information.\n";
}

// Gives `app` (named after the program) the shared conventions. `synopsis`:
// one or more lines, each ending in '\n', the first starting "usage: PROG".
inline void setup(CLI::App& app, std::string synopsis) {
  app.set_help_flag("-h,--help", "print this help and exit");
  app.set_version_flag("--version", app.get_name() + " " + SHUTTLE_VERSION, "print the version and exit");
  auto f = std::make_shared<formatter>(std::move(synopsis));
  f->column_width(30);
  app.formatter(f);
  // As the hand-written parsers did: a repeated option's last value counts
  // (scripts append to a default command line).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.failure_message([](const CLI::App* a, const CLI::Error& e) { return failure_text(*a, e.what()); });
}

// Parses argv into the options bound to `app`; returns only when that
// succeeded. --help and --version exit 0, errors exit 2.
inline void parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
}

// A usage error found after parsing (options that exclude each other): said
// as parse() says its own; exit 2.
[[noreturn]] inline void fail(const CLI::App& app, const std::string& message) {
  std::fputs(failure_text(app, message).c_str(), stderr);
  std::exit(2);
}

namespace detail {
inline std::string range(std::uint64_t min, std::uint64_t max) {
  return std::to_string(min) + "-" + std::to_string(max);
}
inline std::string bad(const std::string& value, const std::string& expected) {
  return "bad value '" + value + "' (" + expected + ")";
}
}  // namespace detail

// A decimal integer in [min, max]. The value is rewritten in canonical
// decimal: CLI11 itself would read "010" as octal and "0x10" as hex.
inline CLI::Validator count(std::uint64_t min, std::uint64_t max) {
  return CLI::Validator(
      [min, max](std::string& s) -> std::string {
        std::uint64_t v = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (s.empty() || ec != std::errc{} || end != s.data() + s.size() || v < min || v > max)
          return detail::bad(s, detail::range(min, max));
        s = std::to_string(v);
        return {};
      },
      "", "count");
}

// A byte count in [min, max]: decimal, optionally followed by k, m or g
// (KiB, MiB, GiB; either case, "KiB" spelled out too). Rewritten as the
// plain number of bytes.
inline CLI::Validator bytes(std::uint64_t min, std::uint64_t max) {
  return CLI::Validator(
      [min, max](std::string& s) -> std::string {
        const std::string expected = detail::range(min, max) + " bytes; suffixes k, m, g";
        std::uint64_t v = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (s.empty() || ec != std::errc{}) return detail::bad(s, expected);
        std::string_view rest(end, static_cast<std::size_t>(s.data() + s.size() - end));
        unsigned shift = 0;
        if (rest == "k" || rest == "K" || rest == "KiB")
          shift = 10;
        else if (rest == "m" || rest == "M" || rest == "MiB")
          shift = 20;
        else if (rest == "g" || rest == "G" || rest == "GiB")
          shift = 30;
        else if (!rest.empty())
          return detail::bad(s, expected);
        if (v > (UINT64_MAX >> shift)) return detail::bad(s, expected);
        v <<= shift;
        if (v < min || v > max) return detail::bad(s, expected);
        s = std::to_string(v);
        return {};
      },
      "", "bytes");
}

// Seconds, fractions allowed, in (0, 1e6]; with `zero_ok`, 0 too.
inline CLI::Validator seconds(bool zero_ok = false) {
  return CLI::Validator(
      [zero_ok](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !std::isfinite(v) || v < 0 || (v == 0 && !zero_ok) || v > 1e6)
          return detail::bad(s, zero_ok ? "seconds, >= 0" : "seconds, > 0");
        return {};
      },
      "", "seconds");
}

// A power of two (0 allowed: "off"); after count(), which made it decimal.
inline CLI::Validator power_of_two() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::uint64_t v = std::strtoull(s.c_str(), nullptr, 10);
        if (v & (v - 1)) return "must be a power of two, not " + s;
        return {};
      },
      "", "power of two");
}

// One of `names`, exactly: "bad value 'x' (a, b, c)".
inline CLI::Validator one_of(std::initializer_list<const char*> names) {
  std::string list;
  for (const char* n : names) list += (list.empty() ? "" : ", ") + std::string(n);
  return CLI::Validator(
      [names = std::vector<std::string>(names.begin(), names.end()), list](std::string& s) -> std::string {
        for (auto& n : names)
          if (s == n) return {};
        return detail::bad(s, list);
      },
      "", "one of");
}

// The --transport names: "tcp", "rdma" ("verbs" taken for it), "tcp-provider",
// "auto". `tcp_means_provider`: in a program with no socket mode, "tcp" can
// only mean the tcp provider.
inline std::optional<transport> parse_transport(std::string_view s, bool tcp_means_provider) {
  if (s == "tcp") return tcp_means_provider ? transport::tcp_provider : transport::socket;
  if (s == "rdma" || s == "verbs") return transport::rdma;
  if (s == "tcp-provider") return transport::tcp_provider;
  if (s == "auto") return transport::automatic;
  return std::nullopt;
}

// A --transport option: one of `allowed`, stored in `out`.
inline CLI::Option* add_transport(CLI::App& app, transport& out, std::initializer_list<transport> allowed,
                                  const std::string& description, bool tcp_means_provider = false) {
  std::string names;
  for (transport a : allowed) names += (names.empty() ? "" : ", ") + std::string(to_string(a));
  auto check = [ok = std::vector<transport>(allowed), names, tcp_means_provider](std::string& s) -> std::string {
    if (auto t = parse_transport(s, tcp_means_provider))
      for (transport a : ok)
        if (a == *t) return {};
    return detail::bad(s, names);
  };
  auto store = [&out, tcp_means_provider](const std::string& s) { out = *parse_transport(s, tcp_means_provider); };
  return app.add_option_function<std::string>("--transport", store, description)
      ->type_name("T")
      ->check(CLI::Validator(check, "", "transport"));
}

}  // namespace cli
