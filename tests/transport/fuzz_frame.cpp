// libFuzzer target for the tcp provider's frame decoder and the target-side
// access checks, exactly as the connection engine applies them: a hello, then
// frames; every one-sided request is checked against a registered region
// before its payload is placed (ASan catches any byte outside it). A frame
// that fails to decode, a truncated one, or a refused access ends the
// "connection", as in the engine.
//
// Addresses: the region is placed at 0x10000 in the fuzzer's address space
// (wrapping arithmetic maps any 64-bit address), so the bounds checks are
// fully explored.
#include "wire.hpp"

#include <shuttle/transport.hpp>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>

using namespace shuttle;
using namespace shuttle::tcp_wire;

namespace {
constexpr std::uint64_t fuzz_base = 0x10000;
constexpr std::uint32_t fuzz_rkey = 0x1234;
constexpr std::size_t region_size = 256;
constexpr std::size_t receive_size = 1024;

[[noreturn]] void fail() { std::abort(); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto bytes = std::as_bytes(std::span(data, size));
  // Exact-size heap blocks: ASan flags any access outside them.
  auto region = std::make_unique<std::uint64_t[]>(region_size / 8);
  auto* base = reinterpret_cast<std::byte*>(region.get());
  auto recvbuf = std::make_unique<std::byte[]>(receive_size);
  auto readback = std::make_unique<std::byte[]>(region_size);
  // Access rights come from the first byte, so every combination is reachable.
  unsigned rights = bytes.empty() ? access::all : (std::to_integer<unsigned>(bytes[0]) & access::all);
  // Its top bit: whether SENDs may carry ACKs and credits (limits::carried).
  const bool carried = !bytes.empty() && (std::to_integer<unsigned>(bytes[0]) & 0x80);
  if (!bytes.empty()) bytes = bytes.subspan(1);

  if (bytes.size() < hello_size) return 0;
  auto hello = decode_hello(bytes.first<hello_size>());
  bytes = bytes.subspan(hello_size);
  if (hello) bytes = bytes.subspan(std::min<std::size_t>(hello->payload_size, bytes.size()));  // its payload

  limits lim;
  lim.max_send = receive_size;
  lim.carried = carried;
  while (bytes.size() >= header_size) {
    auto h = decode_header(bytes.first<header_size>(), lim);
    bytes = bytes.subspan(header_size);
    if (!h) return 0;  // protocol error: the connection closes
    const std::size_t payload = h->payload_length();
    if (payload > bytes.size()) return 0;  // truncated: EOF mid-frame
    auto body = bytes.first(payload);
    bytes = bytes.subspan(payload);
    switch (h->op) {
      case opcode::send:
        if (h->length > receive_size) fail();  // the decoder must have refused it
        // What it carries: only where agreed, an ACK of seq >= 1, 1..max credits.
        if ((h->flags & (flag_ack | flag_credit)) && !carried) fail();
        if ((h->flags & flag_ack) ? h->arg0 == 0 : h->arg0 != 0) fail();
        if ((h->flags & flag_credit) ? h->arg1 == 0 || h->arg1 > max_receive_buffers : h->arg1 != 0) fail();
        std::memcpy(recvbuf.get(), body.data(), body.size());
        break;
      case opcode::write:
      case opcode::write_imm:
      case opcode::read_req:
      case opcode::cas:
      case opcode::faa: {
        region_view view;
        if (h->rkey == fuzz_rkey) view = {base, region_size, rights};
        const std::uint64_t addr = reinterpret_cast<std::uint64_t>(base) + (h->addr - fuzz_base);
        const bool atomic = h->op == opcode::cas || h->op == opcode::faa;
        auto target = check_access(view, addr, h->length, required_access(h->op), atomic);
        if (!target) return 0;  // NAK: the connection goes to the error state
        std::byte* p = *target;
        if (p < base || p + h->length > base + region_size) fail();
        if ((rights & required_access(h->op)) != required_access(h->op)) fail();
        if (h->op == opcode::write || h->op == opcode::write_imm) {
          std::memcpy(p, body.data(), body.size());
        } else if (h->op == opcode::read_req) {
          std::memcpy(readback.get(), p, h->length);
        } else {
          std::atomic_ref<std::uint64_t> w(*reinterpret_cast<std::uint64_t*>(p));
          if (h->op == opcode::faa) {
            (void)w.fetch_add(h->arg0);
          } else {
            std::uint64_t e = h->arg0;
            (void)w.compare_exchange_strong(e, h->arg1);
          }
        }
        break;
      }
      case opcode::write_list:
      case opcode::read_list: {
        // As the reader: the whole table parsed, every descriptor checked
        // before its payload is placed (or read); the first refused one ends it.
        const bool write = h->op == opcode::write_list;
        std::array<list_entry, max_list_entries> es{};
        if (!decode_list_table(*h, body.first(h->table_length()), es)) return 0;  // protocol error
        auto data = body.subspan(h->table_length());
        std::uint64_t sum = 0;
        for (std::size_t i = 0; i < h->arg0; ++i) sum += es[i].length;
        if (sum != h->length || data.size() != (write ? sum : 0)) fail();  // the decoder must have refused it
        region_view view;
        if (h->rkey == fuzz_rkey) view = {base, region_size, rights};
        for (std::size_t i = 0; i < h->arg0; ++i) {
          const std::uint64_t addr = reinterpret_cast<std::uint64_t>(base) + (es[i].addr - fuzz_base);
          auto target = check_access(view, addr, es[i].length, required_access(h->op), false);
          if (!target) return 0;  // NAK
          std::byte* p = *target;
          if (p < base || p + es[i].length > base + region_size) fail();
          if ((rights & required_access(h->op)) != required_access(h->op)) fail();
          if (write) {
            std::memcpy(p, data.data(), es[i].length);
            data = data.subspan(es[i].length);
          } else {
            std::memcpy(readback.get(), p, es[i].length);
          }
        }
        break;
      }
      case opcode::read_list_resp:
        if (body.size() > max_rdma_length || h->arg0 == 0 || h->arg0 > max_list_entries) fail();
        break;
      case opcode::read_resp:
        if (body.size() > max_rdma_length) fail();
        break;
      default:
        if (payload != 0) fail();
        break;
    }
  }
  return 0;
}
