// Copyright kvferry authors. Apache-2.0.
#include "offload/token_bank.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "base/check.h"

namespace kvferry {

// ---- VectorPageMap ------------------------------------------------------------------------------

bool VectorPageMap::Insert(int32_t pos, int32_t slot) {
  if (pos < 0 || pos >= max_positions_ || slot < 0 || slot >= kNone) return false;
  if (static_cast<size_t>(pos) >= slot_of_.size()) {
    // Grow geometrically (bounded by max_positions) so appends cost amortised O(1).
    const size_t want = std::max<size_t>(static_cast<size_t>(pos) + 1, slot_of_.size() * 2);
    const size_t n = std::min<size_t>(std::max<size_t>(want, 1024), max_positions_);
    slot_of_.resize(n, kNone);
  }
  slot_of_[pos] = static_cast<uint16_t>(slot);
  if (dirty_ != nullptr) dirty_->push_back(static_cast<uint32_t>(pos));
  return true;
}

// ---- HashPageMap --------------------------------------------------------------------------------

HashPageMap::HashPageMap(int64_t capacity) {
  const uint64_t cap = std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(capacity, 1)));
  log2_cap_ = std::countr_zero(cap);
  entries_.assign(cap, kEmpty);
}

int32_t HashPageMap::Find(int32_t pos) const {
  const uint64_t mask = entries_.size() - 1;
  uint64_t i = Bucket(pos, log2_cap_);
  for (size_t n = 0; n < entries_.size(); ++n, i = (i + 1) & mask) {
    ++probes_;
    const uint64_t e = entries_[i];
    if (e == kEmpty) return -1;
    if (static_cast<int32_t>(e >> 32) == pos) return static_cast<int32_t>(e & 0xffffffffu);
  }
  return -1;  // full table without the key
}

bool HashPageMap::Insert(int32_t pos, int32_t slot) {
  const uint64_t mask = entries_.size() - 1;
  const uint64_t packed = (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) |
                          static_cast<uint32_t>(slot);
  uint64_t i = Bucket(pos, log2_cap_);
  for (size_t n = 0; n < entries_.size(); ++n, i = (i + 1) & mask) {
    ++probes_;
    const uint64_t e = entries_[i];
    if (e == kEmpty) {
      Set(i, packed);
      ++size_;
      return true;
    }
    if (static_cast<int32_t>(e >> 32) == pos) {
      Set(i, packed);
      return true;
    }
  }
  return false;  // full
}

void HashPageMap::Erase(int32_t pos) {
  const uint64_t mask = entries_.size() - 1;
  uint64_t i = Bucket(pos, log2_cap_);
  size_t n = 0;
  for (; n < entries_.size(); ++n, i = (i + 1) & mask) {
    const uint64_t e = entries_[i];
    if (e == kEmpty) return;
    if (static_cast<int32_t>(e >> 32) == pos) break;
  }
  if (n == entries_.size()) return;
  // Backward-shift deletion: pull later members of the cluster into the hole when their home
  // bucket does not lie cyclically in (hole, j].
  Set(i, kEmpty);
  --size_;
  uint64_t hole = i;
  uint64_t j = (i + 1) & mask;
  for (size_t k = 0; k + 1 < entries_.size(); ++k, j = (j + 1) & mask) {
    const uint64_t e = entries_[j];
    if (e == kEmpty) return;
    const uint64_t home = Bucket(static_cast<int32_t>(e >> 32), log2_cap_);
    const uint64_t dist_home = (j - home) & mask;  // how far e sits from home
    const uint64_t dist_hole = (j - hole) & mask;  // how far the hole is behind e
    if (dist_home >= dist_hole) {
      Set(hole, e);
      Set(j, kEmpty);
      hole = j;
    }
  }
}

void HashPageMap::Clear() {
  std::fill(entries_.begin(), entries_.end(), kEmpty);
  size_ = 0;
}

// ---- TokenBank ----------------------------------------------------------------------------------

TokenBank::TokenBank(Device* device, const TokenBankConfig& config)
    : device_(device), config_(config) {}

Result<std::unique_ptr<TokenBank>> TokenBank::Create(Device* device,
                                                      const TokenBankConfig& config) {
  KVF_CHECK_ARG(device != nullptr, "TokenBank: null device");
  KVF_CHECK_ARG(config.max_sequences >= 1 && config.num_layers >= 1 && config.num_kv_heads >= 1,
                "TokenBank: bad table shape ", config.max_sequences, " x ", config.num_layers,
                " x ", config.num_kv_heads);
  KVF_CHECK_ARG(config.slots >= 1 && config.slots < VectorPageMap::kNone, "TokenBank: slots ",
                config.slots, " out of range [1, ", VectorPageMap::kNone, ")");
  KVF_CHECK_ARG(config.max_positions >= 1 && config.max_positions <= (int64_t{1} << 31) - 1,
                "TokenBank: max_positions ", config.max_positions, " out of range");
  KVF_CHECK_ARG(config.head_dim >= 1, "TokenBank: head_dim ", config.head_dim);
  KVF_CHECK_ARG(config.hash_capacity >= 0 && config.max_admit_per_table >= 0 &&
                    config.max_admit_rows >= 0,
                "TokenBank: negative capacity");
  const int64_t tables = static_cast<int64_t>(config.max_sequences) * config.num_layers *
                         config.num_kv_heads;
  KVF_CHECK_ARG(tables <= 0x7fffffff, "TokenBank: ", tables, " tables");
  std::unique_ptr<TokenBank> bank(new TokenBank(device, config));
  KVF_RETURN_IF_ERROR(bank->Init());
  return Result<std::unique_ptr<TokenBank>>(std::move(bank));
}

namespace {
// Hash map entries per table before HashPageMap rounds them up to a power of two.
int64_t HashCapacityOf(const TokenBankConfig& config) {
  return config.hash_capacity > 0 ? config.hash_capacity
                                  : static_cast<int64_t>(std::bit_ceil(2u * config.slots));
}
}  // namespace

TokenBank::DeviceSizes TokenBank::DeviceSizesFor(const TokenBankConfig& config) {
  const size_t tables =
      static_cast<size_t>(config.max_sequences) * config.num_layers * config.num_kv_heads;
  const size_t row_bytes = static_cast<size_t>(config.head_dim) * DTypeSize(config.kv_dtype);
  DeviceSizes z;
  z.rows = tables * static_cast<size_t>(config.slots) * 2 * row_bytes;
  if (config.device_map) {
    const size_t table_bytes =
        config.map == BankMapKind::kVector
            ? static_cast<size_t>(config.max_positions) * sizeof(uint16_t)
            : static_cast<size_t>(HashPageMap(HashCapacityOf(config)).capacity()) *
                  sizeof(uint64_t);
    z.page_tables = tables * table_bytes;
    z.ref_bits = tables * static_cast<size_t>((config.slots + 31) / 32) * sizeof(uint32_t);
  }
  return z;
}

Status TokenBank::Init() {
  num_tables_ = config_.max_sequences * config_.num_layers * config_.num_kv_heads;
  row_bytes_ = static_cast<size_t>(config_.head_dim) * DTypeSize(config_.kv_dtype);
  bank_bytes_ = DeviceSizesFor(config_).rows;
  KVF_ASSIGN_OR_RETURN(void* bank, device_->AllocDevice(bank_bytes_));
  bank_ = static_cast<char*>(bank);
  if (config_.map == BankMapKind::kVector) {
    vector_maps_.assign(num_tables_, VectorPageMap(config_.max_positions));
  } else {
    hash_maps_.assign(num_tables_, HashPageMap(HashCapacityOf(config_)));
  }
  const size_t slots_total = static_cast<size_t>(num_tables_) * config_.slots;
  pos_of_.assign(slots_total, -1);
  count_.assign(slots_total, 0);
  hand_.assign(num_tables_, 0);
  used_.assign(num_tables_, 0);
  if (config_.max_admit_per_table == 0) config_.max_admit_per_table = std::max(1, config_.slots / 4);
  staging_rows_cap_ = config_.max_admit_rows > 0
                          ? config_.max_admit_rows
                          : std::min<int64_t>(int64_t{64} * num_tables_, int64_t{1} << 20);
  batch_admits_.reserve(static_cast<size_t>(staging_rows_cap_));
  for (int b = 0; b < 2; ++b) {
    // Two RowCopy entries (K and V) per admitted row.
    KVF_ASSIGN_OR_RETURN(void* buf,
                         device_->AllocHost(static_cast<size_t>(staging_rows_cap_) * 2 *
                                            sizeof(RowCopy)));
    staging_[b] = static_cast<RowCopy*>(buf);
    KVF_ASSIGN_OR_RETURN(staging_done_[b], device_->CreateEvent());
  }
  if (config_.device_map) KVF_RETURN_IF_ERROR(InitDeviceMaps());
  return Status::Ok();
}

Status TokenBank::InitDeviceMaps() {
  const size_t tables = static_cast<size_t>(num_tables_);
  const DeviceSizes sizes = DeviceSizesFor(config_);
  const size_t table_bytes = sizes.page_tables / tables;
  if (config_.map == BankMapKind::kHash) {
    hash_cap_ = hash_maps_[0].capacity();
    hash_log2_ = hash_maps_[0].log2_capacity();
  }
  KVF_ASSIGN_OR_RETURN(void* dmap, device_->AllocDevice(sizes.page_tables));
  if (config_.map == BankMapKind::kVector) {
    dev_vector_ = static_cast<uint16_t*>(dmap);
  } else {
    dev_hash_ = static_cast<uint64_t*>(dmap);
  }
  // Both empty markers are all ones (0xffff, ~0): one pinned image of a table resets any table.
  KVF_ASSIGN_OR_RETURN(none_host_, device_->AllocHost(table_bytes));
  std::memset(none_host_, 0xff, table_bytes);
  ref_words_ = (config_.slots + 31) / 32;
  const size_t ref_bytes = sizes.ref_bits;
  KVF_ASSIGN_OR_RETURN(void* refs, device_->AllocDevice(ref_bytes));
  dev_refs_ = static_cast<uint32_t*>(refs);
  KVF_ASSIGN_OR_RETURN(void* rh, device_->AllocHost(ref_bytes));
  refs_host_ = static_cast<uint32_t*>(rh);
  KVF_ASSIGN_OR_RETURN(void* rz, device_->AllocHost(ref_bytes));
  refs_zero_ = static_cast<uint32_t*>(rz);
  std::memset(refs_zero_, 0, ref_bytes);
  ref_acc_.assign(tables * ref_words_, 0);
  KVF_ASSIGN_OR_RETURN(refs_done_, device_->CreateEvent());
  // Map updates: up to 2 entries per admitted row for the vector map; backward-shift deletion can
  // move more hash entries, so room for 8 per row (beyond that a table is copied whole).
  map_staging_cap_ = staging_rows_cap_ * (config_.map == BankMapKind::kVector ? 2 : 8);
  for (int b = 0; b < 2; ++b) {
    KVF_ASSIGN_OR_RETURN(void* st, device_->AllocHost(static_cast<size_t>(map_staging_cap_) *
                                                      sizeof(RowCopy)));
    map_staging_[b] = static_cast<RowCopy*>(st);
    KVF_ASSIGN_OR_RETURN(void* vals, device_->AllocHost(static_cast<size_t>(map_staging_cap_) *
                                                        sizeof(uint64_t)));
    map_values_[b] = static_cast<uint64_t*>(vals);
  }
  dirty_.assign(tables, {});
  for (size_t t = 0; t < tables; ++t) {
    if (config_.map == BankMapKind::kVector) {
      vector_maps_[t].set_dirty_log(&dirty_[t]);
    } else {
      hash_maps_[t].set_dirty_log(&dirty_[t]);
    }
  }
  device_map_bytes_ = tables * table_bytes + ref_bytes;
  const StreamHandle s = device_->default_stream();
  for (int t = 0; t < num_tables_; ++t) {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(
        static_cast<char*>(dmap) + static_cast<size_t>(t) * table_bytes, none_host_, table_bytes,
        s));
  }
  KVF_RETURN_IF_ERROR(device_->CopyAsync(dev_refs_, refs_zero_, ref_bytes, s));
  return device_->SynchronizeStream(s);
}

TokenBank::DeviceTable TokenBank::device_table(int table) const {
  DeviceTable d;
  if (!config_.device_map) return d;
  if (dev_vector_ != nullptr) {
    d.vector_map = dev_vector_ + static_cast<size_t>(table) * config_.max_positions;
    d.vector_len = config_.max_positions;
  } else {
    d.hash_map = dev_hash_ + static_cast<size_t>(table) * hash_cap_;
    d.hash_log2 = hash_log2_;
  }
  d.bank_rows = static_cast<const char*>(SlotK(table, 0));
  d.ref_bits = dev_refs_ + static_cast<size_t>(table) * ref_words_;
  return d;
}

Status TokenBank::SnapshotRefs(StreamHandle stream) {
  if (!config_.device_map) return Status::Ok();
  const size_t ref_bytes = static_cast<size_t>(num_tables_) * ref_words_ * sizeof(uint32_t);
  if (refs_pending_) {  // the previous snapshot was never folded: keep its bits
    KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(refs_done_));
    FoldRefs();
  }
  KVF_RETURN_IF_ERROR(device_->CopyAsync(refs_host_, dev_refs_, ref_bytes, stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(dev_refs_, refs_zero_, ref_bytes, stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(refs_done_, stream));
  refs_pending_ = true;
  return Status::Ok();
}

void TokenBank::FoldRefs() {
  const size_t n = ref_acc_.size();
  for (size_t i = 0; i < n; ++i) ref_acc_[i] |= refs_host_[i];
  refs_pending_ = false;
}

Status TokenBank::ResetDeviceTable(int table) {
  const StreamHandle s = device_->default_stream();
  if (dev_vector_ != nullptr) {
    const size_t bytes = static_cast<size_t>(config_.max_positions) * sizeof(uint16_t);
    KVF_RETURN_IF_ERROR(device_->CopyAsync(
        dev_vector_ + static_cast<size_t>(table) * config_.max_positions, none_host_, bytes, s));
  } else {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(dev_hash_ + static_cast<size_t>(table) * hash_cap_,
                                           none_host_, static_cast<size_t>(hash_cap_) * 8, s));
  }
  KVF_RETURN_IF_ERROR(device_->CopyAsync(dev_refs_ + static_cast<size_t>(table) * ref_words_,
                                         refs_zero_, static_cast<size_t>(ref_words_) * 4, s));
  dirty_[table].clear();
  std::fill(ref_acc_.begin() + static_cast<size_t>(table) * ref_words_,
            ref_acc_.begin() + static_cast<size_t>(table + 1) * ref_words_, 0u);
  return Status::Ok();
}

// Queues the page-table entries written since the last commit (their current values) as 2-byte
// (vector) or 8-byte (hash) bit-exact row copies on the admission stream, after the row copies.
Status TokenBank::CommitMapUpdates() {
  RowCopy* rc = map_staging_[cur_];
  uint64_t* vals = map_values_[cur_];
  int64_t n = 0;
  for (const int t : dirty_tables_) {
    auto& log = dirty_[t];
    if (log.empty()) continue;
    if (n + static_cast<int64_t>(log.size()) > map_staging_cap_) {
      // Too many for the staging buffer: copy the table whole (pageable source, rare).
      if (dev_vector_ != nullptr) {
        const auto& m = vector_maps_[t];
        std::vector<uint16_t> img(static_cast<size_t>(config_.max_positions));
        for (size_t i = 0; i < img.size(); ++i) img[i] = m.raw(static_cast<int64_t>(i));
        KVF_RETURN_IF_ERROR(device_->CopyAsync(
            dev_vector_ + static_cast<size_t>(t) * config_.max_positions, img.data(),
            img.size() * 2, admit_stream_));
        KVF_RETURN_IF_ERROR(device_->SynchronizeStream(admit_stream_));
      } else {
        const auto& m = hash_maps_[t];
        std::vector<uint64_t> img(static_cast<size_t>(hash_cap_));
        for (size_t i = 0; i < img.size(); ++i) img[i] = m.entry(static_cast<int64_t>(i));
        KVF_RETURN_IF_ERROR(device_->CopyAsync(dev_hash_ + static_cast<size_t>(t) * hash_cap_,
                                               img.data(), img.size() * 8, admit_stream_));
        KVF_RETURN_IF_ERROR(device_->SynchronizeStream(admit_stream_));
      }
      log.clear();
      continue;
    }
    for (const uint32_t i : log) {
      if (dev_vector_ != nullptr) {
        vals[n] = vector_maps_[t].raw(i);
        rc[n] = RowCopy{dev_vector_ + static_cast<size_t>(t) * config_.max_positions + i, &vals[n]};
      } else {
        vals[n] = hash_maps_[t].entry(i);
        rc[n] = RowCopy{dev_hash_ + static_cast<size_t>(t) * hash_cap_ + i, &vals[n]};
      }
      ++n;
    }
    log.clear();
  }
  dirty_tables_.clear();
  if (n == 0) return Status::Ok();
  // Same dtype: a bit-exact copy of 1 x 2 bytes (vector) or 4 x 2 bytes (hash) per entry.
  return device_->CopyRows(rc, n, dev_vector_ != nullptr ? 1 : 4, DType::kBF16, DType::kBF16,
                           admit_stream_);
}

TokenBank::~TokenBank() {
  for (int b = 0; b < 2; ++b) {
    if (staging_used_[b]) device_->SynchronizeEvent(staging_done_[b]).IgnoreError();
    if (staging_done_[b] != nullptr) device_->DestroyEvent(staging_done_[b]);
    device_->FreeHost(staging_[b]);
  }
  device_->FreeDevice(bank_);
  if (config_.device_map) {
    if (refs_pending_) device_->SynchronizeEvent(refs_done_).IgnoreError();
    if (refs_done_ != nullptr) device_->DestroyEvent(refs_done_);
    for (int b = 0; b < 2; ++b) {
      device_->FreeHost(map_staging_[b]);
      device_->FreeHost(map_values_[b]);
    }
    device_->FreeHost(refs_host_);
    device_->FreeHost(refs_zero_);
    device_->FreeHost(none_host_);
    device_->FreeDevice(dev_refs_);
    device_->FreeDevice(dev_vector_ != nullptr ? static_cast<void*>(dev_vector_) : dev_hash_);
  }
}

int32_t TokenBank::MapFind(int table, int32_t pos) const {
  return config_.map == BankMapKind::kVector ? vector_maps_[table].Find(pos)
                                             : hash_maps_[table].Find(pos);
}

bool TokenBank::MapInsert(int table, int32_t pos, int32_t slot) {
  return config_.map == BankMapKind::kVector ? vector_maps_[table].Insert(pos, slot)
                                             : hash_maps_[table].Insert(pos, slot);
}

void TokenBank::MapErase(int table, int32_t pos) {
  if (config_.map == BankMapKind::kVector) {
    vector_maps_[table].Erase(pos);
  } else {
    hash_maps_[table].Erase(pos);
  }
}

int32_t TokenBank::Find(int table, int32_t pos) const { return MapFind(table, pos); }

TokenBank::ResolveCounts TokenBank::Resolve(int table, std::span<const int32_t> positions,
                                            const void** hit_k_rows, const void** hit_v_rows,
                                            int32_t* hit_positions, int32_t* miss_positions) {
  ResolveCounts c;
  const size_t base = static_cast<size_t>(table) * config_.slots;
  // One branch per call, not per position: the loop body is specialised per map kind.
  auto run = [&](const auto& map) {
    for (const int32_t pos : positions) {
      const int32_t slot = map.Find(pos);
      if (slot >= 0) {
        hit_k_rows[c.hits] = SlotK(table, slot);
        hit_v_rows[c.hits] = SlotV(table, slot);
        if (hit_positions != nullptr) hit_positions[c.hits] = pos;
        uint8_t& cnt = count_[base + slot];
        if (cnt < kMaxCount) ++cnt;
        ++c.hits;
      } else {
        miss_positions[c.misses++] = pos;
      }
    }
  };
  if (config_.map == BankMapKind::kVector) {
    run(vector_maps_[table]);
  } else {
    run(hash_maps_[table]);
  }
  counters_.lookups += static_cast<int64_t>(positions.size());
  counters_.hits += c.hits;
  counters_.misses += c.misses;
  return c;
}

int32_t TokenBank::PickVictim(int table) {
  const size_t base = static_cast<size_t>(table) * config_.slots;
  // Each full turn lowers every count by one, so kMaxCount + 1 turns always find a victim.
  const int64_t bound = static_cast<int64_t>(config_.slots) * (kMaxCount + 1);
  int32_t& hand = hand_[table];
  for (int64_t n = 0; n < bound; ++n) {
    const int32_t s = hand;
    hand = hand + 1 == config_.slots ? 0 : hand + 1;
    if (pos_of_[base + s] < 0) return s;  // free
    if (!ref_acc_.empty()) {  // device hits since the hand last passed: one access each
      uint32_t& w = ref_acc_[static_cast<size_t>(table) * ref_words_ + (s >> 5)];
      if (w & (1u << (s & 31))) {
        w &= ~(1u << (s & 31));
        if (count_[base + s] < kMaxCount) ++count_[base + s];
      }
    }
    if (count_[base + s] == 0) return s;
    --count_[base + s];
  }
  return -1;
}

Status TokenBank::BeginAdmit(StreamHandle stream, EventHandle after) {
  KVF_CHECK_CODE(!in_batch_, StatusCode::kFailedPrecondition,
                 "TokenBank::BeginAdmit: previous batch not committed");
  if (after != nullptr) KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, after));
  if (staging_used_[cur_]) KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(staging_done_[cur_]));
  if (refs_pending_) {
    KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(refs_done_));
    FoldRefs();
  }
  admit_stream_ = stream;
  cur_rows_ = 0;
  batch_admits_.clear();
  in_batch_ = true;
  return Status::Ok();
}

int64_t TokenBank::Admit(int table, std::span<const int32_t> positions, const void* const* k_src,
                         const void* const* v_src) {
  if (!in_batch_) {
    counters_.rejected += static_cast<int64_t>(positions.size());
    return 0;
  }
  const size_t base = static_cast<size_t>(table) * config_.slots;
  int64_t admitted = 0;
  if (config_.device_map && dirty_[table].empty()) dirty_tables_.push_back(table);
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t pos = positions[i];
    if (MapFind(table, pos) >= 0) continue;  // already banked (duplicate in the list)
    if (admitted >= config_.max_admit_per_table || cur_rows_ >= staging_rows_cap_) {
      counters_.rejected += static_cast<int64_t>(positions.size() - i);
      break;
    }
    const int32_t slot = PickVictim(table);
    if (slot < 0) {
      ++counters_.rejected;
      continue;
    }
    const int32_t old = pos_of_[base + slot];
    if (old >= 0) MapErase(table, old);
    if (!MapInsert(table, pos, slot)) {  // full hash map (capacity < slots) or pos out of range
      if (old >= 0) {
        ++counters_.evicted;
        --used_[table];
      }
      pos_of_[base + slot] = -1;
      count_[base + slot] = 0;
      ++counters_.rejected;
      continue;
    }
    if (old >= 0) {
      ++counters_.evicted;
    } else {
      ++used_[table];
    }
    pos_of_[base + slot] = pos;
    count_[base + slot] = 1;  // survives one pass of the hand
    RowCopy* rc = staging_[cur_] + 2 * cur_rows_;
    rc[0] = RowCopy{SlotK(table, slot), k_src[i]};
    rc[1] = RowCopy{SlotV(table, slot), v_src[i]};
    batch_admits_.emplace_back(table, slot);
    ++cur_rows_;
    ++admitted;
  }
  counters_.admitted += admitted;
  return admitted;
}

Status TokenBank::CommitAdmit() {
  KVF_CHECK_CODE(in_batch_, StatusCode::kFailedPrecondition,
                 "TokenBank::CommitAdmit without BeginAdmit");
  in_batch_ = false;
  if (cur_rows_ == 0 && dirty_tables_.empty()) return Status::Ok();
  Status st = Status::Ok();
  if (cur_rows_ > 0) {
    st = device_->CopyRows(staging_[cur_], 2 * cur_rows_, config_.head_dim, config_.kv_dtype,
                           config_.kv_dtype, admit_stream_);
  }
  if (!st.ok()) {
    AbortBatch();
    return st;
  }
  // The page tables change only after the rows they point to are written (same stream).
  if (config_.device_map) KVF_RETURN_IF_ERROR(CommitMapUpdates());
  st = device_->RecordEvent(staging_done_[cur_], admit_stream_);
  if (!st.ok()) {
    // Without the event no step would wait for the copies: forget their rows. (The copies may
    // still land, in slots that are free now; a later admission's copy to the same slot runs
    // after them on the same stream.)
    AbortBatch();
    return st;
  }
  staging_used_[cur_] = true;
  ready_ = staging_done_[cur_];
  ready_pending_ = true;
  cur_ ^= 1;
  return Status::Ok();
}

void TokenBank::AbortBatch() {
  for (const auto& [table, slot] : batch_admits_) {
    const size_t i = static_cast<size_t>(table) * config_.slots + slot;
    if (pos_of_[i] < 0) continue;  // the slot came up twice in the batch: undone already
    MapErase(table, pos_of_[i]);
    pos_of_[i] = -1;
    count_[i] = 0;
    --used_[table];
  }
  const auto n = static_cast<int64_t>(batch_admits_.size());
  counters_.admitted -= n;
  counters_.rejected += n;
  batch_admits_.clear();
  cur_rows_ = 0;
}

Status TokenBank::WaitReady(StreamHandle stream) {
  if (!ready_pending_) return Status::Ok();
  KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, ready_));
  return Status::Ok();
}

void TokenBank::ResetSequence(int seq_slot) {
  if (seq_slot < 0 || seq_slot >= config_.max_sequences) return;
  const int first = TableIndex(seq_slot, 0, 0);
  const int last = first + config_.num_layers * config_.num_kv_heads;
  for (int t = first; t < last; ++t) {
    if (config_.map == BankMapKind::kVector) {
      vector_maps_[t] = VectorPageMap(config_.max_positions);  // release the O(T) table too
      if (config_.device_map) vector_maps_[t].set_dirty_log(&dirty_[t]);
    } else {
      hash_maps_[t].Clear();
    }
    if (config_.device_map) ResetDeviceTable(t).IgnoreError();
    const size_t base = static_cast<size_t>(t) * config_.slots;
    std::fill(pos_of_.begin() + base, pos_of_.begin() + base + config_.slots, -1);
    std::fill(count_.begin() + base, count_.begin() + base + config_.slots, 0);
    hand_[t] = 0;
    used_[t] = 0;
  }
  if (config_.device_map) device_->SynchronizeStream(device_->default_stream()).IgnoreError();
}

size_t TokenBank::map_bytes() const {
  size_t b = 0;
  for (const auto& m : vector_maps_) b += m.bytes();
  for (const auto& m : hash_maps_) b += m.bytes();
  return b;
}

size_t TokenBank::slot_meta_bytes() const {
  return pos_of_.size() * sizeof(int32_t) + count_.size() * sizeof(uint8_t);
}

}  // namespace kvferry
