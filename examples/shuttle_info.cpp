// shuttle-info: RDMA devices, ports and GIDs; GPUs with their PCIe and NUMA
// placement; which GPU registration path works on this host; which file
// engine gpu_file uses here (SHUTTLE_FILE_ENGINE, cuFile's state).
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/verbs/verbs.hpp>
#ifdef SHUTTLE_HAVE_CUDA
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/gpu_file.hpp>
#include <shuttle/cuda/gpu_memory.hpp>
#endif

#include "cli.hpp"

#include <cctype>
#include <cstdio>
#include <fstream>
#include <string>

namespace {
std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
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
