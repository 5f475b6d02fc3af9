#include <shuttle/error.hpp>

namespace shuttle {

namespace {
class category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "shuttle"; }
  std::string message(int c) const override {
    switch (static_cast<errc>(c)) {
      case errc::eof: return "end of stream";
      case errc::protocol_error: return "protocol error";
      case errc::remote_access_error: return "remote access error";
      case errc::remote_operation_error: return "remote operation error";
      case errc::disconnected: return "disconnected";
      case errc::message_too_long: return "message too long";
      case errc::not_supported: return "not supported";
      case errc::peer_access_refused: return "the peer's one-sided access was refused";
      case errc::idle_timeout: return "idle timeout: nothing arrived from the peer";
      case errc::handshake_timeout:
        return "handshake timed out: the peer took the connection but did not complete shuttle's handshake";
      case errc::not_a_shuttle_peer:
        return "the peer is not a shuttle endpoint (it answered the handshake in another protocol)";
      case errc::wire_version_mismatch: return "the peer speaks another version of shuttle's wire protocol";
      case errc::operation_timeout: return "operation timed out (with_timeout): it was cancelled";
      case errc::no_io_context: return "no io_context on this thread (create one, or run inside a runtime)";
      case errc::unregistered_device_memory:
        return "unregistered GPU memory the NIC cannot reach (no dma-buf, no peer memory): register it first";
    }
    return "unknown shuttle error " + std::to_string(c);
  }

  // The portable condition a code refines, for code that knows only std::errc.
  std::error_condition default_error_condition(int c) const noexcept override {
    switch (static_cast<errc>(c)) {
      case errc::handshake_timeout:
      case errc::operation_timeout: return std::errc::timed_out;
      default: return {c, *this};
    }
  }

  // A code is equivalent to its own shuttle condition, to its default
  // condition, and the refinements of a protocol error to protocol_error.
  bool equivalent(int c, const std::error_condition& cond) const noexcept override {
    if (cond.category() == *this) {
      if (cond.value() == c) return true;
      const auto e = static_cast<errc>(c);
      return static_cast<errc>(cond.value()) == errc::protocol_error &&
             (e == errc::not_a_shuttle_peer || e == errc::wire_version_mismatch);
    }
    return cond == default_error_condition(c);
  }
};
}  // namespace

const std::error_category& shuttle_category() noexcept {
  static const category c;
  return c;
}

}  // namespace shuttle
