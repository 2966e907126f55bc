// Copyright kvferry authors. Apache-2.0.
// The token bank's maps and replacement, on the host-emulated device (runs in CI without a GPU).

#include "offload/token_bank.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <unordered_map>
#include <vector>

namespace kvferry {
namespace {

TEST(TokenBankMaps, VectorMapInsertFindEraseAndBounds) {
  VectorPageMap m(100);
  EXPECT_EQ(m.Find(5), -1);
  EXPECT_TRUE(m.Insert(5, 7));
  EXPECT_TRUE(m.Insert(99, 0));
  EXPECT_FALSE(m.Insert(100, 1));  // past max_positions
  EXPECT_FALSE(m.Insert(-1, 1));
  EXPECT_EQ(m.Find(5), 7);
  EXPECT_EQ(m.Find(99), 0);
  EXPECT_EQ(m.Find(1000), -1);
  m.Erase(5);
  EXPECT_EQ(m.Find(5), -1);
  EXPECT_GT(m.bytes(), 0u);
}

// Positions that all hash to bucket 0 of a table of 2^log2 entries.
std::vector<int32_t> CollidingPositions(int log2, int count) {
  std::vector<int32_t> out;
  for (int32_t p = 0; static_cast<int>(out.size()) < count; ++p) {
    if (HashPageMap::Bucket(p, log2) == 0) out.push_back(p);
  }
  return out;
}

TEST(TokenBankMaps, HashMapCollisionsAndBackwardShiftDelete) {
  HashPageMap m(16);
  ASSERT_EQ(m.capacity(), 16);
  const auto keys = CollidingPositions(m.log2_capacity(), 6);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(m.Insert(keys[i], i));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(m.Find(keys[i]), i) << "key " << keys[i];
  // Deleting from the middle of the cluster must keep the later members reachable.
  m.Erase(keys[1]);
  m.Erase(keys[3]);
  EXPECT_EQ(m.Find(keys[1]), -1);
  EXPECT_EQ(m.Find(keys[3]), -1);
  for (int i : {0, 2, 4, 5}) EXPECT_EQ(m.Find(keys[i]), i) << "key " << keys[i];
  EXPECT_EQ(m.size(), 4);
  ASSERT_TRUE(m.Insert(keys[2], 42));  // update in place
  EXPECT_EQ(m.Find(keys[2]), 42);
  EXPECT_EQ(m.size(), 4);
}

TEST(TokenBankMaps, HashMapFullTable) {
  HashPageMap m(8);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(m.Insert(1000 + i, i));
  EXPECT_FALSE(m.Insert(5000, 9));
  EXPECT_EQ(m.Find(5000), -1);  // a miss in a full table terminates
  for (int i = 0; i < 8; ++i) EXPECT_EQ(m.Find(1000 + i), i);
  m.Erase(1003);
  EXPECT_TRUE(m.Insert(5000, 9));
  EXPECT_EQ(m.Find(5000), 9);
}

TEST(TokenBankMaps, HashMapMatchesModelUnderChurn) {
  std::mt19937 rng(7);
  HashPageMap m(64);
  std::unordered_map<int32_t, int32_t> model;
  for (int step = 0; step < 20000; ++step) {
    const int32_t pos = static_cast<int32_t>(rng() % 200);
    const int op = static_cast<int>(rng() % 3);
    if (op == 0 && model.size() < 48) {
      const int32_t slot = static_cast<int32_t>(rng() % 1000);
      ASSERT_TRUE(m.Insert(pos, slot));
      model[pos] = slot;
    } else if (op == 1) {
      m.Erase(pos);
      model.erase(pos);
    } else {
      const auto it = model.find(pos);
      ASSERT_EQ(m.Find(pos), it == model.end() ? -1 : it->second) << "step " << step;
    }
    ASSERT_EQ(m.size(), static_cast<int64_t>(model.size()));
  }
}

// A tiny host "store": row i of positions is filled with a pattern derived from (table, pos).
struct FakeStore {
  FakeStore(Device* dev, int tables, int positions, int head_dim)
      : dev(dev), tables(tables), positions(positions), head_dim(head_dim) {
    auto r = dev->AllocHost(Bytes());
    EXPECT_TRUE(r.ok());
    data = static_cast<uint16_t*>(r.value());
    for (int t = 0; t < tables; ++t) {
      for (int p = 0; p < positions; ++p) {
        for (int kv = 0; kv < 2; ++kv) {
          for (int d = 0; d < head_dim; ++d) {
            Row(t, p, kv)[d] = static_cast<uint16_t>((t * 7919 + p * 31 + kv * 17 + d) & 0xffff);
          }
        }
      }
    }
  }
  ~FakeStore() { dev->FreeHost(data); }
  size_t Bytes() const { return static_cast<size_t>(tables) * positions * 2 * head_dim * 2; }
  uint16_t* Row(int t, int p, int kv) const {
    return data + ((static_cast<size_t>(t) * positions + p) * 2 + kv) * head_dim;
  }
  Device* dev;
  int tables, positions, head_dim;
  uint16_t* data = nullptr;
};

class TokenBankTest : public ::testing::TestWithParam<BankMapKind> {
 protected:
  void SetUp() override { dev_ = MakeHostDevice(); }
  std::unique_ptr<TokenBank> MakeBank(int slots, int64_t hash_capacity = 0, int max_admit = 0) {
    TokenBankConfig c;
    c.max_sequences = 2;
    c.num_layers = 2;
    c.num_kv_heads = 2;
    c.slots = slots;
    c.max_positions = kPositions;
    c.head_dim = kHeadDim;
    c.kv_dtype = DType::kBF16;
    c.map = GetParam();
    c.hash_capacity = hash_capacity;
    c.max_admit_per_table = max_admit;
    auto r = TokenBank::Create(dev_.get(), c);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return std::move(r).value();
  }
  // Admits positions of table t from the fake store in one batch.
  int64_t AdmitRows(TokenBank& bank, FakeStore& store, int t, const std::vector<int32_t>& pos) {
    std::vector<const void*> k, v;
    for (int32_t p : pos) {
      k.push_back(store.Row(t, p, 0));
      v.push_back(store.Row(t, p, 1));
    }
    EXPECT_TRUE(bank.BeginAdmit(nullptr, nullptr).ok());
    const int64_t n = bank.Admit(t, pos, k.data(), v.data());
    EXPECT_TRUE(bank.CommitAdmit().ok());
    EXPECT_TRUE(bank.WaitReady(nullptr).ok());
    return n;
  }
  struct Resolved {
    std::vector<const void*> k, v;
    std::vector<int32_t> hits, misses;
  };
  Resolved ResolveAll(TokenBank& bank, int t, const std::vector<int32_t>& pos) {
    Resolved r;
    r.k.resize(pos.size());
    r.v.resize(pos.size());
    r.hits.resize(pos.size());
    r.misses.resize(pos.size());
    const auto c = bank.Resolve(t, pos, r.k.data(), r.v.data(), r.hits.data(), r.misses.data());
    r.k.resize(c.hits);
    r.v.resize(c.hits);
    r.hits.resize(c.hits);
    r.misses.resize(c.misses);
    return r;
  }

  static constexpr int kPositions = 512;
  static constexpr int kHeadDim = 64;
  std::unique_ptr<Device> dev_;
};

TEST_P(TokenBankTest, ResolveSplitsHitsAndMissesAndRowsMatchTheStore) {
  auto bank = MakeBank(16);
  FakeStore store(dev_.get(), bank->num_tables(), kPositions, kHeadDim);
  const int t = bank->TableIndex(1, 1, 0);
  const std::vector<int32_t> sel = {3, 9, 100, 511, 0};
  auto r0 = ResolveAll(*bank, t, sel);
  EXPECT_TRUE(r0.hits.empty());
  EXPECT_EQ(r0.misses, sel);
  EXPECT_EQ(AdmitRows(*bank, store, t, {9, 511}), 2);
  auto r1 = ResolveAll(*bank, t, sel);
  EXPECT_EQ(r1.hits, (std::vector<int32_t>{9, 511}));
  EXPECT_EQ(r1.misses, (std::vector<int32_t>{3, 100, 0}));
  for (size_t i = 0; i < r1.hits.size(); ++i) {
    EXPECT_EQ(std::memcmp(r1.k[i], store.Row(t, r1.hits[i], 0), kHeadDim * 2), 0);
    EXPECT_EQ(std::memcmp(r1.v[i], store.Row(t, r1.hits[i], 1), kHeadDim * 2), 0);
  }
  // Another table is unaffected.
  EXPECT_EQ(bank->Find(bank->TableIndex(0, 1, 0), 9), -1);
  EXPECT_EQ(bank->counters().hits, 2);
  EXPECT_EQ(bank->counters().misses, 8);
  EXPECT_EQ(bank->counters().admitted, 2);
}

TEST_P(TokenBankTest, EvictionKeepsRowsThatAreHit) {
  auto bank = MakeBank(8, 0, 8);
  FakeStore store(dev_.get(), bank->num_tables(), kPositions, kHeadDim);
  const int t = 3;
  std::vector<int32_t> first = {10, 11, 12, 13, 14, 15, 16, 17};
  ASSERT_EQ(AdmitRows(*bank, store, t, first), 8);
  // 10 and 11 are hot: hit them several times.
  for (int i = 0; i < 3; ++i) ResolveAll(*bank, t, {10, 11});
  // Admit 4 new rows: four victims, none of them hot.
  ASSERT_EQ(AdmitRows(*bank, store, t, {100, 101, 102, 103}), 4);
  EXPECT_EQ(bank->counters().evicted, 4);
  EXPECT_GE(bank->Find(t, 10), 0);
  EXPECT_GE(bank->Find(t, 11), 0);
  for (int32_t p : {100, 101, 102, 103}) EXPECT_GE(bank->Find(t, p), 0) << p;
  int cold_left = 0;
  for (int32_t p = 12; p <= 17; ++p) cold_left += bank->Find(t, p) >= 0;
  EXPECT_EQ(cold_left, 2);
  EXPECT_EQ(bank->rows_used(t), 8);
  // Rows still match the store after slot reuse.
  auto r = ResolveAll(*bank, t, {100, 101, 102, 103, 10, 11});
  ASSERT_EQ(r.hits.size(), 6u);
  for (size_t i = 0; i < r.hits.size(); ++i) {
    EXPECT_EQ(std::memcmp(r.k[i], store.Row(t, r.hits[i], 0), kHeadDim * 2), 0);
    EXPECT_EQ(std::memcmp(r.v[i], store.Row(t, r.hits[i], 1), kHeadDim * 2), 0);
  }
}

TEST_P(TokenBankTest, AdmissionIsBoundedPerTableAndSkipsDuplicates) {
  auto bank = MakeBank(32, 0, 4);
  FakeStore store(dev_.get(), bank->num_tables(), kPositions, kHeadDim);
  EXPECT_EQ(AdmitRows(*bank, store, 0, {1, 1, 2, 3, 4, 5, 6}), 4);
  EXPECT_EQ(bank->counters().admitted, 4);
  EXPECT_EQ(AdmitRows(*bank, store, 0, {1, 2, 5}), 1);  // 1 and 2 are in already
}

TEST_P(TokenBankTest, ResetSequenceForgetsItsTables) {
  auto bank = MakeBank(8);
  FakeStore store(dev_.get(), bank->num_tables(), kPositions, kHeadDim);
  const int t0 = bank->TableIndex(0, 1, 1), t1 = bank->TableIndex(1, 1, 1);
  AdmitRows(*bank, store, t0, {5});
  AdmitRows(*bank, store, t1, {5});
  bank->ResetSequence(0);
  EXPECT_EQ(bank->Find(t0, 5), -1);
  EXPECT_GE(bank->Find(t1, 5), 0);
  EXPECT_EQ(bank->rows_used(t0), 0);
}

// A decode-like stream with persistence and churn: both maps must take the same decisions (the
// map is only an index), and the hash map must use much less page-table memory.
TEST(TokenBankMapsAgree, SameHitsEvictionsAndLessMemoryForHash) {
  auto dev = MakeHostDevice();
  std::unique_ptr<TokenBank> banks[2];
  for (int m = 0; m < 2; ++m) {
    TokenBankConfig c;
    c.slots = 64;
    c.max_positions = 1 << 16;
    c.head_dim = 64;
    c.map = m == 0 ? BankMapKind::kVector : BankMapKind::kHash;
    c.max_admit_per_table = 16;
    auto r = TokenBank::Create(dev.get(), c);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    banks[m] = std::move(r).value();
  }
  const int positions = 1 << 16;
  FakeStore store(dev.get(), 1, positions, 64);
  std::mt19937 rng(3);
  std::vector<int32_t> sel(96);
  for (auto& p : sel) p = static_cast<int32_t>(rng() % positions);
  for (int step = 0; step < 200; ++step) {
    for (int i = 0; i < 8; ++i) sel[rng() % sel.size()] = static_cast<int32_t>(rng() % positions);
    std::vector<int32_t> misses[2];
    for (int m = 0; m < 2; ++m) {
      std::vector<const void*> k(sel.size()), v(sel.size());
      std::vector<int32_t> hp(sel.size()), mp(sel.size());
      const auto c = banks[m]->Resolve(0, sel, k.data(), v.data(), hp.data(), mp.data());
      mp.resize(c.misses);
      misses[m] = mp;
      std::vector<const void*> ks, vs;
      for (int32_t p : mp) {
        ks.push_back(store.Row(0, p, 0));
        vs.push_back(store.Row(0, p, 1));
      }
      ASSERT_TRUE(banks[m]->BeginAdmit(nullptr, nullptr).ok());
      banks[m]->Admit(0, mp, ks.data(), vs.data());
      ASSERT_TRUE(banks[m]->CommitAdmit().ok());
    }
    ASSERT_EQ(misses[0], misses[1]) << "step " << step;
  }
  const auto& a = banks[0]->counters();
  const auto& b = banks[1]->counters();
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.evicted, b.evicted);
  EXPECT_GT(a.hit_rate(), 0.3);
  EXPECT_LT(banks[1]->map_bytes(), banks[0]->map_bytes() * 6 / 10);
}

TEST(TokenBankHash, FullMapRejectsAdmission) {
  auto dev = MakeHostDevice();
  TokenBankConfig c;
  c.slots = 16;
  c.max_positions = 4096;
  c.head_dim = 64;
  c.map = BankMapKind::kHash;
  c.hash_capacity = 4;  // fewer entries than slots: the map fills first
  c.max_admit_per_table = 16;
  auto r = TokenBank::Create(dev.get(), c);
  ASSERT_TRUE(r.ok());
  auto bank = std::move(r).value();
  FakeStore store(dev.get(), 1, 4096, 64);
  std::vector<int32_t> pos = {1, 2, 3, 4, 5, 6};
  std::vector<const void*> k, v;
  for (int32_t p : pos) {
    k.push_back(store.Row(0, p, 0));
    v.push_back(store.Row(0, p, 1));
  }
  ASSERT_TRUE(bank->BeginAdmit(nullptr, nullptr).ok());
  EXPECT_EQ(bank->Admit(0, pos, k.data(), v.data()), 4);
  ASSERT_TRUE(bank->CommitAdmit().ok());
  EXPECT_EQ(bank->counters().rejected, 2);
  for (int32_t p : {1, 2, 3, 4}) EXPECT_GE(bank->Find(0, p), 0);
}

TEST(TokenBankConfigCheck, RejectsBadConfig) {
  auto dev = MakeHostDevice();
  TokenBankConfig c;
  c.slots = 0;
  c.max_positions = 10;
  EXPECT_EQ(TokenBank::Create(dev.get(), c).status().code(), StatusCode::kInvalidArgument);
  c.slots = 70000;
  EXPECT_EQ(TokenBank::Create(dev.get(), c).status().code(), StatusCode::kInvalidArgument);
}

// The device page tables (config.device_map) mirror the host maps after every commit (on the
// host-emulated device "device memory" is host memory, so the copy is read directly), and the
// reference bitmap the kernel sets stands in for host hits in CLOCK.
class TokenBankDeviceMapTest : public ::testing::TestWithParam<BankMapKind> {};

TEST_P(TokenBankDeviceMapTest, MirrorMatchesHostMapsUnderChurnAndReset) {
  auto dev = MakeHostDevice();
  TokenBankConfig c;
  c.max_sequences = 2;
  c.num_kv_heads = 2;
  c.slots = 32;
  c.max_positions = 1000;
  c.head_dim = 64;
  c.map = GetParam();
  c.max_admit_per_table = 16;
  c.device_map = true;
  auto r = TokenBank::Create(dev.get(), c);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto bank = std::move(r).value();
  EXPECT_GT(bank->device_map_bytes(), 0u);
  FakeStore store(dev.get(), bank->num_tables(), 1000, 64);
  std::mt19937 rng(3);
  auto check = [&](int t) {
    const auto d = bank->device_table(t);
    ASSERT_EQ(d.bank_rows, bank->SlotK(t, 0));
    for (int32_t p = 0; p < 1000; ++p) {
      int32_t dev_slot = -1;
      if (d.vector_map != nullptr) {
        ASSERT_EQ(d.vector_len, 1000);
        dev_slot = d.vector_map[p] == 0xffff ? -1 : d.vector_map[p];
      } else {
        // Probe the device copy exactly as the kernel does.
        const uint32_t mask = (1u << d.hash_log2) - 1;
        uint32_t i = HashPageMap::Bucket(p, d.hash_log2);
        for (uint32_t n = 0; n <= mask; ++n, i = (i + 1) & mask) {
          const uint64_t e = d.hash_map[i];
          if (e == ~uint64_t{0}) break;
          if (static_cast<int32_t>(e >> 32) == p) {
            dev_slot = static_cast<int32_t>(e & 0xffffffffu);
            break;
          }
        }
      }
      ASSERT_EQ(dev_slot, bank->Find(t, p)) << "table " << t << " pos " << p;
    }
  };
  for (int step = 0; step < 20; ++step) {
    ASSERT_TRUE(bank->BeginAdmit(nullptr, nullptr).ok());
    for (int t = 0; t < bank->num_tables(); ++t) {
      std::vector<int32_t> pos;
      std::vector<const void*> k, v;
      for (int i = 0; i < 12; ++i) {
        pos.push_back(static_cast<int32_t>(rng() % 1000));
        k.push_back(store.Row(t, pos.back(), 0));
        v.push_back(store.Row(t, pos.back(), 1));
      }
      bank->Admit(t, pos, k.data(), v.data());
    }
    ASSERT_TRUE(bank->CommitAdmit().ok());
    ASSERT_TRUE(bank->WaitReady(nullptr).ok());
    for (int t = 0; t < bank->num_tables(); ++t) check(t);
  }
  EXPECT_GT(bank->counters().evicted, 0);
  bank->ResetSequence(1);
  for (int t = 0; t < bank->num_tables(); ++t) check(t);
}

TEST_P(TokenBankDeviceMapTest, ReferenceBitsKeepHitRowsLikeHostHits) {
  auto dev = MakeHostDevice();
  TokenBankConfig c;
  c.slots = 8;
  c.max_positions = 512;
  c.head_dim = 64;
  c.map = GetParam();
  c.max_admit_per_table = 8;
  c.device_map = true;
  auto bank = std::move(TokenBank::Create(dev.get(), c)).value();
  FakeStore store(dev.get(), 1, 512, 64);
  auto admit = [&](const std::vector<int32_t>& pos) {
    std::vector<const void*> k, v;
    for (int32_t p : pos) {
      k.push_back(store.Row(0, p, 0));
      v.push_back(store.Row(0, p, 1));
    }
    EXPECT_TRUE(bank->BeginAdmit(nullptr, nullptr).ok());
    const int64_t n = bank->Admit(0, pos, k.data(), v.data());
    EXPECT_TRUE(bank->CommitAdmit().ok());
    return n;
  };
  ASSERT_EQ(admit({10, 11, 12, 13, 14, 15, 16, 17}), 8);
  // The kernel's hits on 10 and 11, three steps in a row.
  for (int i = 0; i < 3; ++i) {
    const auto d = bank->device_table(0);
    for (int32_t p : {10, 11}) {
      const int32_t s = bank->Find(0, p);
      d.ref_bits[s >> 5] |= 1u << (s & 31);
    }
    ASSERT_TRUE(bank->SnapshotRefs(nullptr).ok());
    bank->CountDeviceLookups(2, 0);
    EXPECT_EQ(d.ref_bits[0], 0u);  // reset for the next step
    ASSERT_TRUE(bank->BeginAdmit(nullptr, nullptr).ok());  // folds the snapshot
    ASSERT_TRUE(bank->CommitAdmit().ok());
  }
  ASSERT_EQ(admit({100, 101, 102, 103}), 4);
  EXPECT_GE(bank->Find(0, 10), 0);
  EXPECT_GE(bank->Find(0, 11), 0);
  int cold_left = 0;
  for (int32_t p = 12; p <= 17; ++p) cold_left += bank->Find(0, p) >= 0;
  EXPECT_EQ(cold_left, 2);
  EXPECT_EQ(bank->counters().hits, 6);
  EXPECT_EQ(bank->counters().lookups, 6);
}

INSTANTIATE_TEST_SUITE_P(TokenBank, TokenBankDeviceMapTest,
                         ::testing::Values(BankMapKind::kVector, BankMapKind::kHash),
                         [](const auto& info) {
                           return info.param == BankMapKind::kVector ? "Vector" : "Hash";
                         });

INSTANTIATE_TEST_SUITE_P(TokenBank, TokenBankTest,
                         ::testing::Values(BankMapKind::kVector, BankMapKind::kHash),
                         [](const auto& info) {
                           return info.param == BankMapKind::kVector ? "Vector" : "Hash";
                         });

}  // namespace
}  // namespace kvferry
