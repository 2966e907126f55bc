// Copyright kvferry authors. Apache-2.0.
// The host implementation of a planned decode step (DecodeStepArgs): what the host-emulated
// device runs, stage by stage as the CUDA kernels do, so both backends execute the same plan.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "base/bank_map.h"
#include "base/offload_split.h"
#include "base/psaw.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "cpu/select_items.h"

namespace kvferry::cpu {
namespace {

struct ItemRows {
  const char* resident_k;
  size_t resident_v_offset;
  const KvPages kv;
};

}  // namespace

void DecodeStep(const DecodeStepArgs& a) {
  const AttnParams& p = a.params;
  const int hkv = a.num_kv_heads, d = p.head_dim, group = p.group;
  const int64_t hq = static_cast<int64_t>(hkv) * group;
  const size_t elem = DTypeSize(p.kv_dtype);
  const size_t row_bytes = static_cast<size_t>(d) * elem;
  const int64_t rows_per_slot = static_cast<int64_t>(a.sink) + a.window;

  auto item_rows = [&](int slot, int h) {
    const int64_t t = (static_cast<int64_t>(slot) * a.num_layers + a.layer) * hkv + h;
    return ItemRows{a.resident + static_cast<size_t>(t * 2 * rows_per_slot) * row_bytes,
                    static_cast<size_t>(rows_per_slot) * row_bytes,
                    KvPages{a.store.pages + t * a.store.max_pages, a.store.page_tokens}};
  };

  // 1 append (all items first, as the CUDA append kernel completes before attention starts).
  for (int32_t b = 0; b < a.batch; ++b) {
    const int slot = a.slots[b];
    const int64_t pos = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer];
    const int64_t n = pos + 1;
    ConvertSpan(a.q_f32 + b * hq * d, DType::kF32,
                static_cast<const char*>(a.q) + b * hq * d * DTypeSize(a.q_dtype), a.q_dtype,
                hq * d);
    for (int h = 0; h < hkv; ++h) {
      const ItemRows r = item_rows(slot, h);
      const int64_t src = (static_cast<int64_t>(b) * hkv + h) * d;
      const void* ks = static_cast<const char*>(a.k) + src * DTypeSize(a.k_dtype);
      const void* vs = static_cast<const char*>(a.v) + src * DTypeSize(a.v_dtype);
      if (!a.host_writes_store) {
        ConvertSpan(const_cast<void*>(PagedKRow(r.kv, pos, d, elem)), p.kv_dtype, ks, a.k_dtype, d);
        ConvertSpan(const_cast<void*>(PagedVRow(r.kv, pos, d, elem)), p.kv_dtype, vs, a.v_dtype, d);
      }
      const int64_t row = ResidentRowOf(pos, n, a.sink, a.window);
      if (row >= 0) {
        char* rk = const_cast<char*>(r.resident_k) + static_cast<size_t>(row) * row_bytes;
        ConvertSpan(rk, p.kv_dtype, ks, a.k_dtype, d);
        ConvertSpan(rk + r.resident_v_offset, p.kv_dtype, vs, a.v_dtype, d);
      }
    }
  }

  // 2 attend and 3 combine, item by item.
  thread_local std::vector<const void*> k_rows, v_rows;
  thread_local std::vector<float> o, lse;
  o.resize(static_cast<size_t>(group) * d);
  lse.resize(static_cast<size_t>(group));
  for (int32_t b = 0; b < a.batch; ++b) {
    const int slot = a.slots[b];
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int h = 0; h < hkv; ++h) {
      const int64_t item = static_cast<int64_t>(b) * hkv + h;
      const ItemRows r = item_rows(slot, h);
      int64_t count = 0;
      StepRange range;
      if (a.mode == StepRowMode::kList) {
        count = a.list_count[item];
      } else {
        range = SinksAndRecent(n, a.sink, StepBudget(a.budget_tokens, a.budget_fraction,
                                                     a.budget_cap, n));
        count = range.count;
      }
      k_rows.resize(static_cast<size_t>(count));
      v_rows.resize(static_cast<size_t>(count));
      for (int64_t j = 0; j < count; ++j) {
        const int64_t pos = a.mode == StepRowMode::kList
                                ? a.list[item * a.list_cap + j]
                                : (j < range.sinks ? j : range.recent_begin + (j - range.sinks));
        const int64_t row = ResidentRowOf(pos, n, a.sink, a.window);
        if (row >= 0) {
          k_rows[j] = r.resident_k + static_cast<size_t>(row) * row_bytes;
          v_rows[j] = r.resident_k + static_cast<size_t>(row) * row_bytes + r.resident_v_offset;
        } else {
          k_rows[j] = PagedKRow(r.kv, pos, d, elem);
          v_rows[j] = PagedVRow(r.kv, pos, d, elem);
        }
      }
      const float* q = a.q_f32 + b * hq * d + static_cast<int64_t>(h) * group * d;
      const RowAttnItem it{q, o.data(), lse.data(), k_rows.data(), v_rows.data(),
                           static_cast<int32_t>(count)};
      AttendRows(p, &it, 1);
      const int64_t row0 = b * hq + static_cast<int64_t>(h) * group;  // first query head's row
      if (a.o_cpu != nullptr) {
        MergeLseRef(o.data(), lse.data(), a.o_cpu + row0 * d, a.lse_cpu + row0, group, d);
      }
      ConvertSpan(static_cast<char*>(a.out) + row0 * d * DTypeSize(a.out_dtype), a.out_dtype,
                  o.data(), DType::kF32, static_cast<int64_t>(group) * d);
      if (a.lse != nullptr) {
        for (int g = 0; g < group; ++g) a.lse[row0 + g] = lse[g];
      }
    }
  }
}

void ExactTopKSelect(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, int64_t k,
                     std::vector<float>& logits, std::vector<float>& weights, int32_t* out) {
  k = std::min(k, n);
  if (k <= 0) return;
  logits.resize(static_cast<size_t>(n) * p.group);
  weights.assign(static_cast<size_t>(n), 0.0f);
  ScorePaged(p, q, kv, n, logits.data());
  for (int g = 0; g < p.group; ++g) {
    SoftmaxAccumulate(logits.data() + static_cast<int64_t>(g) * n, n, 1.0f, weights.data());
  }
  TopK(weights.data(), n, k, out);
  std::sort(out, out + k);
}

Status ForEachSelectItem(const void* args, const RankItem& rank) {
  const DecodeStepArgs& a = *static_cast<const DecodeStepArgs*>(args);
  const AttnParams& p = a.params;
  const int hkv = a.num_kv_heads, d = p.head_dim, group = p.group;
  const int64_t hq = static_cast<int64_t>(hkv) * group;
  const size_t elem = DTypeSize(p.kv_dtype);
  thread_local std::vector<float> q;
  q.resize(static_cast<size_t>(group) * d);
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t slot = a.slots[b];
    const int64_t pos = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer];
    const int64_t n = pos + 1;
    const int64_t k = std::min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
    for (int h = 0; h < hkv; ++h) {
      const int64_t item = static_cast<int64_t>(b) * hkv + h;
      const int64_t t = (slot * a.num_layers + a.layer) * hkv + h;
      const KvPages kv{a.store.pages + t * a.store.max_pages, a.store.page_tokens};
      const int64_t src = item * d;
      ConvertSpan(const_cast<void*>(PagedKRow(kv, pos, d, elem)), p.kv_dtype,
                  static_cast<const char*>(a.k) + src * DTypeSize(a.k_dtype), a.k_dtype, d);
      ConvertSpan(q.data(), DType::kF32,
                  static_cast<const char*>(a.q) + (b * hq + h * group) * d * DTypeSize(a.q_dtype),
                  a.q_dtype, static_cast<int64_t>(group) * d);
      int32_t* out = a.list + item * a.list_cap;
      const SelectItem it{item, t, pos, n, k, q.data(), kv, out};
      a.list_count[item] = static_cast<int32_t>(rank(a, it));
      if (a.hide_fraction > 0.0) {
        a.list_count[item] = static_cast<int32_t>(PsawFilterList(
            out, a.list_count[item], n, a.sink, k, PsawHiddenEndOf(a.hide_fraction, n)));
      }
    }
  }
  return Status::Ok();
}

void SplitStepList(const DecodeStepArgs& a, const SplitListArgs& s) {
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t item = static_cast<int64_t>(b) * a.num_kv_heads + h;
      const int32_t* list = a.list + item * a.list_cap;
      const int64_t count = a.list_count[item];
      int64_t misses = 0;
      for (int64_t j = 0; j < count; ++j) misses += ResidentRowOf(list[j], n, a.sink, a.window) < 0;
      const int64_t keep = misses - SplitCpuRows(misses, s.cpu_q10);  // misses the device reads
      int32_t* gpu = s.gpu_list + item * a.list_cap;
      int32_t* cpu = s.cpu_list + item * a.list_cap;
      int64_t n_gpu = 0, n_cpu = 0, seen = 0;
      for (int64_t j = 0; j < count; ++j) {
        const bool miss = ResidentRowOf(list[j], n, a.sink, a.window) < 0;
        if (miss && seen++ >= keep) {
          cpu[n_cpu++] = list[j];
        } else {
          gpu[n_gpu++] = list[j];
        }
      }
      s.gpu_count[item] = static_cast<int32_t>(n_gpu);
      s.cpu_count[item] = static_cast<int32_t>(n_cpu);
    }
  }
}

void PrefetchListRows(const DecodeStepArgs& a) {
  const size_t row_bytes = static_cast<size_t>(a.params.head_dim) * DTypeSize(a.params.kv_dtype);
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  const StepBankView& bank = a.bank;
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t slot = a.slots[b];
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t item = static_cast<int64_t>(b) * a.num_kv_heads + h;
      const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
      const int32_t* list = a.list + item * a.list_cap;
      char* stage = bank.stage + static_cast<size_t>(item * a.list_cap) * 2 * row_bytes;
      for (int64_t j = 0; j < a.list_count[item]; ++j) {
        const int32_t pos = list[j];
        if (ResidentRowOf(pos, n, a.sink, a.window) >= 0) continue;
        bool hit = false;
        if (bank.vmap != nullptr) {
          hit = bank.vmap[t * bank.max_positions + pos] != 0xffff;
        } else if (bank.hmap != nullptr) {
          // HashPageMap's probing (gpu/bank_map.cuh): packed (pos << 32 | slot), ~0 empty.
          const unsigned long long* table = bank.hmap + (t << bank.hash_log2);
          const uint32_t mask = (1u << bank.hash_log2) - 1;
          uint32_t i = HashPageMap::Bucket(pos, bank.hash_log2);
          for (uint32_t k = 0; k <= mask; ++k, i = (i + 1) & mask) {
            const unsigned long long e = table[i];
            if (e == ~0ull) break;
            if (static_cast<int32_t>(e >> 32) == pos) {
              hit = true;
              break;
            }
          }
        }
        if (hit) continue;
        const uint32_t p = static_cast<uint32_t>(pos) / pt, off = static_cast<uint32_t>(pos) % pt;
        const char* page = static_cast<const char*>(a.store.pages[t * a.store.max_pages + p]);
        std::memcpy(stage + static_cast<size_t>(j) * 2 * row_bytes, page + off * row_bytes, row_bytes);
        std::memcpy(stage + (static_cast<size_t>(j) * 2 + 1) * row_bytes, page + (pt + off) * row_bytes,
                    row_bytes);
      }
    }
  }
}

}  // namespace kvferry::cpu
