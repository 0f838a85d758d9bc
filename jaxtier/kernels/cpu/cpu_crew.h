// Helper threads shared by jaxtier's CPU kernels (jaxtier/matmul_cpu.cc and
// jaxtier/kvcache/paged_attention_cpu.cc; built into one library by jaxtier/cpu_kernels.py).
//
// A kernel call splits its work into items that any thread may claim from an atomic counter (a
// `Job`), or (`Job::Split`) into one contiguous range of items per thread, each thread taking
// what is left of the others' ranges once its own is done. `RunJob` drains it on the calling
// thread and offers it to up to n crew threads beside. Why not XLA's intra-op pool: it wakes a
// sleeping thread per scheduled task, and a decode step's kernel calls are short, so in most calls
// the pool's helper arrived after the caller had claimed every item, and a small projection ran
// on one core, short of the memory bandwidth. Crew threads spin for `kSpin` after their last job
// (pausing, and yielding the core to any other runnable thread every few microseconds), so the
// next call of the same step finds them awake; after that they sleep on a condition variable
// until a job wakes them.
//
// One crew per process, one thread per core beside the caller's (the process's CPU affinity),
// created on first use and never destroyed. A job offered while another is still running replaces
// it in the slot: the earlier caller keeps draining its own job, so every job completes.

#ifndef JAXTIER_CPU_CREW_H_
#define JAXTIER_CPU_CREW_H_

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

namespace jaxtier {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Work that the caller and any crew thread claim item by item: `items` calls of `RunItem`.
struct Job {
  virtual ~Job() = default;
  virtual void RunItem(int64_t item) = 0;

  // Claims and runs items until none is left to claim.
  void Drain() {
    if (parts <= 1) {
      for (;;) {
        const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
        if (item >= items) return;
        Run(item);
      }
    }
    for (;;) {  // the shared items, in order
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= shared) break;
      Run(item);
    }
    // Then this thread's own range, then what is left of the others'.
    const int64_t me = joined.fetch_add(1, std::memory_order_relaxed) % parts;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t part = (me + i) % parts;
      const int64_t end = PartStart(part + 1);
      for (;;) {
        const int64_t item = cursor[part].fetch_add(1, std::memory_order_relaxed);
        if (item >= end) break;
        Run(item);
      }
    }
  }

  // Splits the items from `first_owned` on into `n` (<= kMaxParts) contiguous ranges, one per
  // thread that drains the job; the items before it are claimed in order by whoever comes.
  void Split(int64_t first_owned, int64_t n) {
    shared = first_owned;
    parts = std::clamp<int64_t>(n, 1, kMaxParts);
    for (int64_t p = 0; p < parts; ++p) cursor[p].store(PartStart(p), std::memory_order_relaxed);
  }

  static constexpr int64_t kMaxParts = 8;
  int64_t items = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int64_t> seats{0};  // crew threads still allowed to join

 private:
  void Run(int64_t item) {
    RunItem(item);
    done.fetch_add(1, std::memory_order_release);
  }
  int64_t PartStart(int64_t part) const {
    return shared + (items - shared) * part / parts;
  }
  int64_t shared = 0, parts = 1;
  std::atomic<int64_t> joined{0};
  std::atomic<int64_t> cursor[kMaxParts];
};

class Crew {
 public:
  static Crew& Get() {
    static Crew* crew = new Crew();  // never destroyed: detached threads outlive any caller
    return *crew;
  }

  // Crew threads there are (cores beside the caller's).
  int64_t size() const { return size_; }

  // Lets up to `helpers` crew threads drain `job` beside the caller. Returns at once.
  void Offer(const std::shared_ptr<Job>& job, int64_t helpers) {
    if (helpers <= 0 || size_ == 0) return;
    job->seats.store(helpers, std::memory_order_relaxed);
    std::atomic_store_explicit(&current_, job, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_all();
    }
  }

 private:
  static constexpr std::chrono::microseconds kSpin{500};

  Crew() {
    int64_t cores = std::thread::hardware_concurrency();
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
#endif
    size_ = std::max<int64_t>(0, cores - 1);
    for (int64_t i = 0; i < size_; ++i) std::thread([this] { Serve(); }).detach();
  }

  void Serve() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto deadline = std::chrono::steady_clock::now() + kSpin;
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if ((spins & 63) == 63) {
          if (std::chrono::steady_clock::now() > deadline) {
            std::unique_lock<std::mutex> lock(mu_);
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
            sleepers_.fetch_sub(1, std::memory_order_seq_cst);
            break;
          }
          std::this_thread::yield();
        }
        CpuRelax();
      }
      seen = generation_.load(std::memory_order_acquire);
      const std::shared_ptr<Job> job = std::atomic_load_explicit(&current_,
                                                                 std::memory_order_acquire);
      if (job && job->seats.fetch_sub(1, std::memory_order_relaxed) > 0) job->Drain();
    }
  }

  int64_t size_ = 0;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleepers_{0};
  std::mutex mu_;
  std::condition_variable wake_;
};

// Runs every item of `job` on the calling thread and up to `helpers` crew threads; returns when all
// are done. Helpers hold the job alive (shared_ptr) and find the counter spent if they start late.
inline void RunJob(const std::shared_ptr<Job>& job, int64_t helpers) {
  Crew& crew = Crew::Get();
  crew.Offer(job, std::min(helpers, crew.size()));
  job->Drain();
  // Items that helpers claimed are in progress on running threads: wait for them.
  while (job->done.load(std::memory_order_acquire) < job->items) std::this_thread::yield();
}

}  // namespace jaxtier

#endif  // JAXTIER_CPU_CREW_H_
