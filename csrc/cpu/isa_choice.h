// The run-time choice among an op's kernel tables, one per instruction set (scalar, avx2,
// avx512): the widest this CPU runs (cpu_features.h), or the one the environment variable
// ZEROCORE_CPU_ISA names (read once, at the op's first call), or, for tests and benchmarks, the
// one a hook op names. Every table of one op computes the same bits, so the choice changes speed
// only. Kernels is any struct with a `const char* name`.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace zerocore::cpu {

template <class Kernels>
class IsaChoice {
 public:
  // op: the op's name in messages; the tables, null where that ISA was not compiled in.
  IsaChoice(const char* op, const Kernels* scalar, const Kernels* avx2, const Kernels* avx512)
      : op_(op) {
    runnable_.push_back(scalar);
    if (avx2 != nullptr && cpu_runs_avx2()) {
      runnable_.push_back(avx2);
      if (avx512 != nullptr && cpu_runs_avx512()) runnable_.push_back(avx512);
    }
  }

  const Kernels* active() {
    std::call_once(once_, [this] {
      const Kernels* chosen = runnable_.back();
      const char* env = std::getenv("ZEROCORE_CPU_ISA");
      if (env != nullptr && *env != '\0' && std::string(env) != "auto") {
        chosen = find(env);
        TORCH_CHECK(chosen != nullptr, "zerocore: ZEROCORE_CPU_ISA=", env, " is not one this CPU "
                    "and build can run (", names(), ", or auto)");
      }
      const Kernels* expected = nullptr;  // set only if the hook ran first
      active_.compare_exchange_strong(expected, chosen);
    });
    return active_.load(std::memory_order_relaxed);
  }

  // The hook: with a name, makes that ISA's tables the ones used from now on (in this process);
  // returns the name of the ISA in use.
  std::string hook(const c10::optional<std::string>& name) {
    active();
    if (name.has_value()) {
      const Kernels* k = find(*name);
      TORCH_CHECK(k != nullptr, "zerocore._cpu_", op_, "_isa: '", *name, "' is not one this CPU "
                  "and build can run (", names(), ")");
      active_.store(k);
    }
    return active()->name;
  }

  // The ISAs this build has kernels for and this CPU and OS can run, narrowest first.
  std::vector<std::string> runnable() const {
    std::vector<std::string> out;
    for (const Kernels* k : runnable_) out.emplace_back(k->name);
    return out;
  }

 private:
  const Kernels* find(const std::string& name) const {
    for (const Kernels* k : runnable_) {
      if (name == k->name) return k;
    }
    return nullptr;
  }

  std::string names() const {
    std::string out;
    for (const Kernels* k : runnable_) out += std::string(out.empty() ? "" : ", ") + k->name;
    return out;
  }

  const char* op_;
  std::vector<const Kernels*> runnable_;
  std::atomic<const Kernels*> active_{nullptr};
  std::once_flag once_;
};

}  // namespace zerocore::cpu
