// shuttle-info: RDMA devices, ports and GIDs; GPUs with their PCIe and NUMA
// placement; which GPU registration path works on this host; which file
// engine gpu_file uses here (SHUTTLE_FILE_ENGINE, cuFile's state); which
// path a host buffer and a GPU buffer take to a peer on this host under
// transport_kind::automatic (found by connecting to one).
#include <shuttle/local.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/verbs/verbs.hpp>
#ifdef SHUTTLE_HAVE_CUDA
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/gpu_file.hpp>
#include <shuttle/cuda/gpu_memory.hpp>
#endif

#include "cli.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {
std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// A peer on this host under transport_kind::automatic (SHUTTLE_TRANSPORT
// and SHUTTLE_AUTO_LOCAL apply): connects to one on loopback, says which
// provider the connection took, writes a host buffer through it, and which
// registration path a GPU buffer takes on that domain.
shuttle::task<void> local_peer_paths() {
  using namespace shuttle;
  std::printf("Peers on this host (transport auto):\n");
  auto sd = domain::open(), cd = domain::open();
  if (!sd || !cd) {
    std::printf("  cannot open a domain: %s\n", (sd ? cd.error() : sd.error()).message().c_str());
    co_return;
  }
  auto l = sd->listen(endpoint::loopback(0));
  if (!l) {
    std::printf("  cannot listen on loopback: %s\n", l.error().message().c_str());
    co_return;
  }
  auto [s, c] = co_await when_all(with_timeout(l->accept(), std::chrono::seconds(10)),
                                  cd->connect(endpoint::loopback(l->local_endpoint()->port())));
  if (!s || !c) {
    std::printf("  cannot connect to one: %s\n", (c ? s.error() : c.error()).message().c_str());
    co_return;
  }
  const bool local = c->kind() == transport_kind::local;
  std::printf("  connection: %s provider (%s)\n", to_string(c->kind()), local ? "same host" : "not local: overridden");
  // A host buffer the peer writes into: shared memory on the local path.
  auto block = shared_memory::allocate(1 << 20);
  auto mr = block ? sd->register_memory(block->span(), access::local_write | access::remote_write)
                  : result<memory_region>(block.error());
  std::vector<std::byte> data(1 << 20, std::byte{0x5a});
  auto w = mr ? co_await c->write(data, mr->remote()) : result<void>(mr.error());
  const bool arrived = w && std::equal(data.begin(), data.end(), block->data());
  if (local)
    std::printf("  host buffer from shared_memory::allocate: the peer's write/read is a memcpy in its mapping "
                "(zero-copy); other host memory: through the Unix socket (a 1 MiB write %s)\n",
                arrived ? "arrived" : "FAILED");
  else
    std::printf("  host buffer: through the %s provider (a 1 MiB write %s)\n", to_string(c->kind()),
                arrived ? "arrived" : "FAILED");
#ifdef SHUTTLE_HAVE_CUDA
  if (cuda::device_count() > 0) {
    cuda::gpu_registry reg(*cd);
    try {
      cuda::device_buffer buf(4 << 20);
      auto r = reg.register_memory(buf.data(), buf.size(), access::local_write | access::remote_write);
      if (r)
        std::printf("  GPU buffer: %s (%s), then over the %s connection\n", cuda::to_string(r->path),
                    r->reason.c_str(), to_string(c->kind()));
      else
        std::printf("  GPU buffer: no registration path: %s\n", r.error().message().c_str());
    } catch (const std::exception& e) {
      std::printf("  GPU buffer: probe failed: %s\n", e.what());
    }
  } else {
    std::printf("  GPU buffer: no CUDA device\n");
  }
#else
  std::printf("  GPU buffer: shuttle built without CUDA\n");
#endif
  (void)co_await c->close();
  (void)co_await s->close();
}
}  // namespace

int main(int argc, char** argv) {
  using namespace shuttle;
  CLI::App app{"RDMA devices, ports and GIDs; GPUs with their PCIe and NUMA placement; the GPU registration path "
               "that works on this host.",
               "shuttle-info"};
  cli::setup(app, "usage: shuttle-info\n");
  cli::parse(app, argc, argv);
  std::printf("RDMA devices:\n");
  auto devs = verbs::list_devices();
  if (!devs || devs->empty()) std::printf("  none\n");
  if (devs)
    for (auto& d : *devs) {
      std::string numa = read_line("/sys/class/infiniband/" + d.name + "/device/numa_node");
      std::printf("  %s  guid %s  NUMA %s\n", d.name.c_str(), d.node_guid.c_str(), numa.empty() ? "?" : numa.c_str());
      for (auto& p : d.ports) {
        std::printf("    port %d: %s, %s, MTU %d\n", p.port, p.state.c_str(), p.link_layer.c_str(), p.active_mtu);
        for (auto& g : p.gids) std::printf("      gid[%d] %s (%s)\n", g.index, g.gid.c_str(), g.type.c_str());
      }
    }
  if (devs && !devs->empty()) {
    const std::error_code why = verbs::memory_monitor_status();
    if (why)
      std::printf("registration cache (memory the user did not register): off: %s\n", why.message().c_str());
    else
      std::printf("registration cache (memory the user did not register): on (userfaultfd memory monitor)\n");
  }
  {
    io_context ctx;
    ctx.run(local_peer_paths());
  }
#ifdef SHUTTLE_HAVE_CUDA
  int n = cuda::device_count();
  std::printf("GPUs: %d\n", n);
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    (void)cudaGetDeviceProperties(&p, i);
    char bus[32];
    std::snprintf(bus, sizeof bus, "%04x:%02x:%02x.0", p.pciDomainID, p.pciBusID, p.pciDeviceID);
    std::string numa = read_line(std::string("/sys/bus/pci/devices/") + bus + "/numa_node");
    std::string cpus = read_line(std::string("/sys/bus/pci/devices/") + bus + "/local_cpulist");
    std::printf("  GPU %d: %s\n    PCIe %s, NUMA node %s, local CPUs %s\n", i, cuda::describe_device(i).c_str(), bus,
                numa.empty() ? "?" : numa.c_str(), cpus.empty() ? "?" : cpus.c_str());
    (void)cudaSetDevice(i);
    auto c = cuda::probe_gdr(i);
    std::printf("    %s\n", c.describe().c_str());
    io_context ctx;
    auto d = domain::open();
    if (d) {
      cuda::gpu_registry reg(*d);
      try {
        cuda::device_buffer buf(4 << 20);
        auto r = reg.register_memory(buf.data(), buf.size(), access::local_write | access::remote_write);
        if (r)
          std::printf("    registration path on %s: %s (%s)\n", d->describe().c_str(), cuda::to_string(r->path),
                      r->reason.c_str());
      } catch (const std::exception& e) {
        std::printf("    registration probe failed: %s\n", e.what());
      }
    }
  }
  std::printf("  %s\n", cuda::describe_file_engines().c_str());
#else
  std::printf("GPUs: shuttle built without CUDA\n");
#endif
  return 0;
}
