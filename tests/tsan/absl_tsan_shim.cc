// ThreadSanitizer annotations for Debian's uninstrumented Abseil.
//
// Debian builds libabsl_synchronization without -fsanitize=thread, so TSan
// cannot see absl::Mutex's locking: every access guarded by one looks like a
// race. Linked into every binary under --config=tsan (as the custom malloc
// library, the one hook Bazel offers to add a library to every cc_binary and
// cc_test), this file defines the exported synchronization entry points
// itself. A definition in the executable interposes on the shared library's,
// for calls from our code and from other shared libraries (gRPC) alike; each
// wrapper tells TSan what the call does (lock, unlock, release, acquire) with
// the annotations Abseil itself uses in instrumented builds, and calls the
// real function found with dlsym(RTLD_NEXT).
//
// Only calls from instrumented code (the executable and the workspace's own
// shared libraries) are annotated. Calls from Debian's libraries (gRPC and
// Abseil itself) pass straight through: their own synchronization is built
// from atomics TSan cannot see either, so annotating their mutexes alone
// reports "races" on memory they handed over correctly. A nested call (the
// real AwaitWithTimeout calling AwaitWithDeadline) is not annotated twice.
//
// Condition evaluation inside Lock/Await happens between TSan's pre- and
// post- annotations, where TSan ignores memory accesses: races inside
// absl::Condition functions are missed, never invented. Calls inside the
// shared library itself (Notification -> Mutex) are direct and not seen;
// ckptd uses only Mutex, MutexLock, Await*, CondVar-free code and
// BlockingCounter (wrapped below).
#include <dlfcn.h>
#include <link.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace {

void* Real(const char* mangled) {
  void* f = dlsym(RTLD_NEXT, mangled);
  if (f == nullptr) {
    std::fprintf(stderr, "absl_tsan_shim: %s not found in the next library: %s\n", mangled,
                 dlerror());
    std::abort();
  }
  return f;
}

template <typename Fn>
Fn RealFn(const char* mangled) {
  return reinterpret_cast<Fn>(Real(mangled));
}

#define REAL(type, mangled)                          \
  static const auto real = RealFn<type>(mangled)

// Address ranges of the loaded objects that are not instrumented (system
// libraries), rebuilt when a caller lies in no known object (a dlopen).
struct Range {
  uintptr_t begin, end;
  bool system;
};
// Read without a lock (an acquire load that synchronizes only with the
// rare rebuild): a lock here would order every two threads that take any
// mutex and hide real races. Replaced tables are leaked.
std::atomic<std::vector<Range>*> ranges{nullptr};
std::mutex rebuild_mu;

int AddObject(dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name != nullptr ? info->dlpi_name : "";
  const bool system = std::strncmp(name, "/usr/", 5) == 0 || std::strncmp(name, "/lib", 4) == 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    const uintptr_t b = info->dlpi_addr + ph.p_vaddr;
    static_cast<std::vector<Range>*>(out)->push_back({b, b + ph.p_memsz, system});
  }
  return 0;
}

bool FromSystemLibrary(const void* caller) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(caller);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (const std::vector<Range>* table = ranges.load(std::memory_order_acquire)) {
      for (const Range& r : *table) {
        if (a >= r.begin && a < r.end) return r.system;
      }
    }
    std::lock_guard<std::mutex> l(rebuild_mu);
    auto* fresh = new std::vector<Range>();
    dl_iterate_phdr(AddObject, fresh);
    ranges.store(fresh, std::memory_order_release);
  }
  return false;
}

thread_local int depth = 0;

// Whether this call is annotated: the outermost wrapper on the thread, called
// from instrumented code.
class Scope {
 public:
  explicit Scope(const void* caller) : annotate_(depth++ == 0 && !FromSystemLibrary(caller)) {}
  ~Scope() { --depth; }
  bool annotate() const { return annotate_; }

 private:
  bool annotate_;
};

// Mutex::Await* and CondVar::Wait* release `mu` while they wait and hold it
// again on return: to TSan, an unlock and a lock around the call (the call
// itself inside the lock's ignore window, where conditions are evaluated).
template <typename Call>
auto WaitReleasing(absl::Mutex* mu, Call call) {
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  __tsan_mutex_pre_lock(mu, 0);
  if constexpr (std::is_void_v<decltype(call())>) {
    call();
    __tsan_mutex_post_lock(mu, 0, 0);
  } else {
    const auto r = call();
    __tsan_mutex_post_lock(mu, 0, 0);
    return r;
  }
}

#define SCOPE(...)                                  \
  Scope scope(__builtin_return_address(0));         \
  if (!scope.annotate()) return real(__VA_ARGS__)

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv");
  SCOPE(this);
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::Unlock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv");
  SCOPE(this);
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderLock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  SCOPE(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
}

void Mutex::ReaderUnlock() {
  REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  SCOPE(this);
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

bool Mutex::TryLock() {
  REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv");
  SCOPE(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool ok = real(this);
  __tsan_mutex_post_lock(
      this, ok ? __tsan_mutex_try_lock : __tsan_mutex_try_lock | __tsan_mutex_try_lock_failed, 0);
  return ok;
}

bool Mutex::ReaderTryLock() {
  REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  SCOPE(this);
  const unsigned f = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(this, f);
  const bool ok = real(this);
  __tsan_mutex_post_lock(this, ok ? f : f | __tsan_mutex_try_lock_failed, 0);
  return ok;
}

void Mutex::LockWhen(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  SCOPE(this, cond);
  __tsan_mutex_pre_lock(this, 0);
  real(this, cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, Duration),
       "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  SCOPE(this, cond, timeout);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = real(this, cond, timeout);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, Time),
       "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  SCOPE(this, cond, deadline);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = real(this, cond, deadline);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

void Mutex::Await(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  SCOPE(this, cond);
  return WaitReleasing(this, [&] { return real(this, cond); });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, Duration),
       "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  SCOPE(this, cond, timeout);
  return WaitReleasing(this, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, Time),
       "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  SCOPE(this, cond, deadline);
  return WaitReleasing(this, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  REAL(void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  SCOPE(this, mu);
  return WaitReleasing(mu, [&] { return real(this, mu); });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  REAL(bool (*)(CondVar*, Mutex*, Duration),
       "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  SCOPE(this, mu, timeout);
  return WaitReleasing(mu, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  REAL(bool (*)(CondVar*, Mutex*, Time),
       "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  SCOPE(this, mu, deadline);
  return WaitReleasing(mu, [&] { return real(this, mu, deadline); });
}

bool BlockingCounter::DecrementCount() {
  REAL(bool (*)(BlockingCounter*), "_ZN4absl7debian315BlockingCounter14DecrementCountEv");
  SCOPE(this);
  __tsan_release(this);
  return real(this);
}

void BlockingCounter::Wait() {
  REAL(void (*)(BlockingCounter*), "_ZN4absl7debian315BlockingCounter4WaitEv");
  SCOPE(this);
  real(this);
  __tsan_acquire(this);
}

ABSL_NAMESPACE_END
}  // namespace absl

// Suppressions, all for uninstrumented third-party code (TSan reads these
// from the binary: no file to find from every test's and daemon's cwd).
// called_from_lib: TSan ignores what its interceptors see being called from
// these libraries (each pattern must name exactly one; epoll, fd and allocation events, atomics in their
// headers' code compiled into them). gRPC's threads hand work to each other
// through its own lock-free queues and absl::call_once, which TSan cannot
// see in an uninstrumented library, so without this every gRPC server reports
// its poller's epoll fd as a race between the thread that created it and the
// thread that waits on it. Our code's accesses stay fully checked.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgrpc++.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libaddress_sorting.so\n"
         // Abseil's deadlock detector (GraphCycles, under its own spin lock)
         // and Mutex internals.
         "called_from_lib:libabsl_graphcycles_internal.so\n"
         "called_from_lib:libabsl_synchronization.so\n"
         "called_from_lib:libabsl_base.so\n";
}

// spdlog's default logger is created on first use inside libspdlog, behind
// synchronization TSan does not see, and its inline logging code (compiled
// into our instrumented objects) then reads it from other threads. Creating
// it here, before main and so before any thread, orders that creation before
// every use. (spdlog is not in called_from_lib: its mutexes are locked in
// the library and unlocked in inline code, and TSan must see both.)
__attribute__((constructor)) void CreateSpdlogDefaultLoggerFirst() {
  spdlog::default_logger_raw();
}
