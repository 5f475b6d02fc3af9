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
    }
    return "unknown shuttle error " + std::to_string(c);
  }
};
}  // namespace

const std::error_category& shuttle_category() noexcept {
  static const category c;
  return c;
}

}  // namespace shuttle
