// Fake CUDA for a CPU-only torch build: a device guard and CUDA hooks, so that tensors whose
// device is "cuda" can exist (tests/helpers/fake_cuda wraps real CPU tensors in them).
//
// Why C++: a CPU build has no device guard for DeviceType::CUDA, so creating any tensor on
// "cuda" (even a wrapper subclass that never touches device memory) fails, and the autograd
// engine needs a guard for every device it runs a backward on. `import torch` creates the
// CUDA hooks object once, so this library must be loaded before torch: the process is started
// with LD_PRELOAD=<this .so> (tests/helpers/fake_cuda/build.py compiles and caches it).
//
// Streams and events are no-ops with distinct ids, so device-generic torch.Stream /
// torch.Event / torch.accelerator.current_stream work. Pinned memory is real host memory from
// the CPU allocator whose pointers are remembered, so x.pin_memory(), x.is_pinned() and
// torch.empty(..., pin_memory=True) behave as on a CUDA build (the instrument needs to tell a
// non-blocking copy from pinned memory from a blocking copy of pageable memory).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
using c10::StreamId;

constexpr DeviceIndex kDevices = 1;
thread_local DeviceIndex current_device = 0;
thread_local StreamId current_stream = 0;
std::atomic<StreamId> next_stream{1};
std::atomic<long> event_syncs{0}, stream_syncs{0}, device_syncs{0};

struct FakeCudaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  FakeCudaGuardImpl() = default;
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, current_device);
    current_device = d.index() < 0 ? 0 : d.index();
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current_device); }
  void setDevice(Device d) const override { current_device = d.index() < 0 ? 0 : d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { current_device = d.index() < 0 ? 0 : d.index(); }
  Stream getStream(Device d) const override { return Stream(Stream::UNSAFE, d, current_stream); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::UNSAFE, d, 0); }
  Stream getStreamFromGlobalPool(Device d, bool) const override {
    return Stream(Stream::UNSAFE, d, next_stream.fetch_add(1));
  }
  Stream getNewStream(Device d, int) const override { return Stream(Stream::UNSAFE, d, next_stream.fetch_add(1)); }
  Stream exchangeStream(Stream s) const override {
    StreamId old = current_stream;
    current_stream = s.id();
    return Stream(Stream::UNSAFE, s.device(), old);
  }
  DeviceIndex deviceCount() const noexcept override { return kDevices; }
  // Events: a recorded event is a non-null dummy handle; everything completes at once.
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(static_cast<uintptr_t>(1));
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override { stream_syncs++; }
  void synchronizeEvent(void*) const override { event_syncs++; }
  void synchronizeDevice(const DeviceIndex) const override { device_syncs++; }
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
};

// Pinned host memory: CPU allocations whose pointers are remembered until freed.
std::mutex pinned_mutex;
std::unordered_set<const void*>& pinned() {
  static auto* set = new std::unordered_set<const void*>();
  return *set;
}

void pinned_delete(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned().erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned().insert(ptr);
    }
    return {ptr, ptr, &pinned_delete, Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

PinnedAllocator pinned_allocator;

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuardImpl);

namespace at {
// The registry key is the class name: it must be CUDAHooks.
struct CUDAHooks : public CUDAHooksInterface {
  CUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return kDevices; }
  int getNumGPUs() const override { return kDevices; }
  DeviceIndex current_device() const override { return current_device_index(); }
  DeviceIndex getCurrentDevice() const override { return current_device_index(); }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned().count(data) > 0;
  }
  Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  void deviceSynchronize(DeviceIndex) const override { device_syncs++; }

 private:
  static DeviceIndex current_device_index() { return 0; }
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at

// Read by tests/helpers/fake_cuda through ctypes: how often the host waited on the fake device
// (event.synchronize(), stream.synchronize(), device synchronize), for code that reaches the
// guard without a Python call the instrument can patch.
extern "C" long moepar_fake_cuda_syncs(int which) {
  return which == 0 ? event_syncs.load() : which == 1 ? stream_syncs.load() : device_syncs.load();
}
extern "C" int moepar_fake_cuda_loaded() { return 1; }
