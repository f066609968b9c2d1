// _holder_index: the private core of remote_g2.holder_index.HolderIndex.
//
// A block hash -> set of holder ids (uint32, 1..2**32-1) table for the
// registry's prefix lookups. The contracts live in the Python facade's
// docstrings; this file says how.
//
// Layout (why): a lookup walks up to 128 hashes of a chain and, for each,
// asks whether one or two candidate holders still hold it. With a million
// hashes every probe misses the cache, so the cost of a walk is the number of
// cache lines it touches. One 64-byte, line-aligned Slot per hash holds all a
// probe needs: the tag (settles most mismatches without the key), the key's
// 32 bytes, the holder count and the first 3 holder ids. Most hashes have at
// most 3 holders, so a probe usually costs one line; a hash with more keeps
// the rest in a sorted overflow array (one more line, only when a candidate
// is not among the inline 3). The alternatives cost more lines per probe: a
// separate tag array means a second miss for the key, and a Python
// dict[bytes, set[int]] goes through the dict, the bytes object, the set and
// its table.
//
// Open addressing with linear probing: the next slot of a run is the next
// line, which the adjacent-line prefetcher often brings in anyway. Load stays
// in 0.35..0.7 (grow x2 beyond 0.7): ~1.2 to ~2.2 slots per hit. Deletion is
// backward-shift, so remove/add churn leaves no tombstones to lengthen runs.
// The table never shrinks (clear() frees it): the registry's holder set grows
// and shrinks with the fleet, and a rehash on the way down would stall a
// lookup for no lasting gain.
//
// Threading: none of its own. Every call keeps the GIL for its whole run and
// runs no Python code between reading its arguments and finishing with the
// table, so calls are atomic with respect to each other; the registry
// serialises them with its own lock anyway. Calls are a few µs: releasing the
// GIL would cost more than it frees.

#include "block_key.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace remote_g2;

constexpr long long kMaxHolder = 0xffffffffLL;
constexpr uint32_t kInline = 3;
// How many hashes ahead walk() prefetches: the probes of a chain are
// independent, so their misses can overlap instead of queueing one by one.
constexpr size_t kPrefetchAhead = 8;

struct alignas(64) Slot {
  uint64_t tag;            // Key::tag; 0 = empty
  uint32_t count;          // holders: inl[0 .. min(count, 3)) + overflow
  uint32_t more;           // index into Table::overflow_ when count > 3
  uint32_t inl[kInline];   // the first holders, in no particular order
  uint32_t unused;
  uint64_t key[4];         // Key::w: the hash's bytes, zero-padded
};
static_assert(sizeof(Slot) == 64, "one slot, one cache line");

class Table {
 public:
  Table() : slots_(kMinSlots), mask_(kMinSlots - 1) {}

  size_t size() const { return size_; }
  int64_t entries() const { return entries_; }

  const Slot *find(const Key &k) const {
    for (size_t i = home(k.tag);; i = (i + 1) & mask_) {
      const Slot &s = slots_[i];
      if (s.tag == 0) return nullptr;
      if (same_key(s, k)) return &s;
    }
  }

  void prefetch(const Key &k) const { __builtin_prefetch(&slots_[home(k.tag)]); }

  bool holds(const Slot &s, uint32_t holder) const {
    uint32_t n = std::min(s.count, kInline);
    for (uint32_t i = 0; i < n; ++i)
      if (s.inl[i] == holder) return true;
    if (s.count <= kInline) return false;
    const std::vector<uint32_t> &v = overflow_[s.more];
    return std::binary_search(v.begin(), v.end(), holder);
  }

  // The holders of s, sorted ascending.
  void holders(const Slot &s, std::vector<uint32_t> &out) const {
    out.assign(s.inl, s.inl + std::min(s.count, kInline));
    if (s.count > kInline)
      out.insert(out.end(), overflow_[s.more].begin(), overflow_[s.more].end());
    std::sort(out.begin(), out.end());
  }

  // Adds holder to each key; returns how many pairs were new. All or
  // nothing: the only failure is bad_alloc, and then the pairs added so far
  // are removed again (`added` is caller-owned scratch for that).
  int64_t add(const Key *keys, size_t n, uint32_t holder,
              std::vector<uint8_t> &added) {
    added.assign(n, 0);
    // Grow once, before any change, so no insert below can need to. Only
    // when the batch might not fit is it worth probing for the absent keys
    // (a repeat counts twice: an upper bound is enough).
    if (!fits(size_ + n)) {
      size_t absent = 0;
      for (size_t i = 0; i < n; ++i) absent += find(keys[i]) == nullptr;
      grow_to_fit(size_ + absent);
    }
    int64_t fresh = 0;
    size_t i = 0;
    try {
      for (; i < n; ++i) {
        added[i] = add_one(keys[i], holder);
        fresh += added[i];
      }
    } catch (...) {
      while (i-- > 0)
        if (added[i]) remove_one(keys[i], holder);
      throw;
    }
    return fresh;
  }

  // Removes holder from each key; returns how many pairs existed.
  int64_t remove(const Key *keys, size_t n, uint32_t holder) noexcept {
    int64_t gone = 0;
    for (size_t i = 0; i < n; ++i) gone += remove_one(keys[i], holder);
    return gone;
  }

  // out[j] = 1 + the number of consecutive keys from keys[1] that
  // cands[j] holds; keys[0] is taken as held. `alive` is scratch.
  void walk(const Key *keys, size_t n, const uint32_t *cands, size_t m,
            std::vector<size_t> &out, std::vector<size_t> &alive) const {
    out.assign(m, n);
    alive.resize(m);
    for (size_t j = 0; j < m; ++j) alive[j] = j;
    for (size_t i = 1; i < std::min(n, 1 + kPrefetchAhead); ++i)
      prefetch(keys[i]);
    size_t live = m;
    for (size_t i = 1; i < n && live > 0; ++i) {
      if (i + kPrefetchAhead < n) prefetch(keys[i + kPrefetchAhead]);
      const Slot *s = find(keys[i]);
      size_t kept = 0;
      for (size_t a = 0; a < live; ++a) {
        size_t j = alive[a];
        if (s && holds(*s, cands[j]))
          alive[kept++] = j;
        else
          out[j] = i;
      }
      live = kept;
    }
  }

  void clear() {
    std::vector<Slot> fresh(kMinSlots);  // allocate first: bad_alloc changes nothing
    slots_.swap(fresh);
    mask_ = kMinSlots - 1;
    std::vector<std::vector<uint32_t>>().swap(overflow_);
    std::vector<uint32_t>().swap(free_);
    size_ = 0;
    entries_ = 0;
  }

 private:
  static constexpr size_t kMinSlots = 16;

  size_t home(uint64_t tag) const { return size_t(tag >> 6) & mask_; }

  // Keys are zero-padded and the tag carries the length, so four word
  // compares decide equality, all on the slot's own line.
  static bool same_key(const Slot &s, const Key &k) {
    return s.tag == k.tag && s.key[0] == k.w[0] && s.key[1] == k.w[1] &&
           s.key[2] == k.w[2] && s.key[3] == k.w[3];
  }

  bool fits(size_t hashes) const { return hashes * 10 <= slots_.size() * 7; }

  void grow_to_fit(size_t hashes) {
    size_t cap = slots_.size();
    while (hashes * 10 > cap * 7) cap <<= 1;
    if (cap == slots_.size()) return;
    std::vector<Slot> bigger(cap);  // may throw: nothing has changed yet
    size_t mask = cap - 1;
    for (const Slot &s : slots_) {
      if (s.tag == 0) continue;
      size_t i = size_t(s.tag >> 6) & mask;
      while (bigger[i].tag != 0) i = (i + 1) & mask;
      bigger[i] = s;
    }
    slots_.swap(bigger);
    mask_ = mask;
  }

  // Needs room for one more hash (add() grew the table first). Strong
  // guarantee: if it throws (bad_alloc), nothing changed.
  bool add_one(const Key &k, uint32_t holder) {
    size_t i = home(k.tag);
    for (; slots_[i].tag != 0; i = (i + 1) & mask_) {
      Slot &s = slots_[i];
      if (!same_key(s, k)) continue;
      if (holds(s, holder)) return false;
      if (s.count < kInline) {
        s.inl[s.count] = holder;
      } else if (s.count == kInline) {
        s.more = new_overflow(holder);
      } else {
        std::vector<uint32_t> &v = overflow_[s.more];
        v.insert(std::upper_bound(v.begin(), v.end(), holder), holder);
      }
      ++s.count;
      ++entries_;
      return true;
    }
    Slot &s = slots_[i];
    s = Slot{};
    s.tag = k.tag;
    std::memcpy(s.key, k.w, sizeof s.key);
    s.count = 1;
    s.inl[0] = holder;
    ++size_;
    ++entries_;
    return true;
  }

  bool remove_one(const Key &k, uint32_t holder) noexcept {
    size_t i = home(k.tag);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].tag == 0) return false;
      if (same_key(slots_[i], k)) break;
    }
    Slot &s = slots_[i];
    uint32_t *inl_end = s.inl + std::min(s.count, kInline);
    uint32_t *at = std::find(s.inl, inl_end, holder);
    if (s.count > kInline) {
      std::vector<uint32_t> &v = overflow_[s.more];
      if (at != inl_end) {  // refill the inline hole from the overflow
        *at = v.back();
        v.pop_back();
      } else {
        auto it = std::lower_bound(v.begin(), v.end(), holder);
        if (it == v.end() || *it != holder) return false;
        v.erase(it);
      }
      if (v.empty()) free_overflow(s.more);
    } else {
      if (at == inl_end) return false;
      *at = *(inl_end - 1);
    }
    --s.count;
    --entries_;
    if (s.count == 0) erase_slot(i);
    return true;
  }

  // Backward shift: pull later slots of the probe run into the hole unless
  // that would move them before their home slot.
  void erase_slot(size_t i) noexcept {
    for (size_t j = (i + 1) & mask_; slots_[j].tag != 0; j = (j + 1) & mask_) {
      size_t h = home(slots_[j].tag);
      if (((j - h) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].tag = 0;
    --size_;
  }

  // An overflow array holding `first`; throws before any change.
  uint32_t new_overflow(uint32_t first) {
    std::vector<uint32_t> v(1, first);
    if (!free_.empty()) {
      uint32_t at = free_.back();
      free_.pop_back();
      overflow_[at].swap(v);
      return at;
    }
    // Keep room to free every array, so free_overflow() never allocates
    // (remove and the rollback in add must not throw).
    free_.reserve(overflow_.size() + 1);
    overflow_.push_back(std::move(v));
    return uint32_t(overflow_.size() - 1);
  }

  void free_overflow(uint32_t at) noexcept {
    std::vector<uint32_t>().swap(overflow_[at]);
    free_.push_back(at);
  }

  std::vector<Slot> slots_;  // power-of-two size
  size_t mask_;
  std::vector<std::vector<uint32_t>> overflow_;  // holders beyond the 3rd, sorted
  std::vector<uint32_t> free_;                   // unused overflow_ indices
  size_t size_ = 0;                              // occupied slots (hashes)
  int64_t entries_ = 0;                          // (hash, holder) pairs
};

// ---------------------------------------------------------------------------
// Reading arguments: TypeError (not bytes / not an int), ValueError (hash
// length, holder id out of range, empty walk).

uint32_t read_holder(PyObject *o) {
  int overflow;
  long long v = read_long_long(o, overflow);  // TypeError for a non-int
  if (overflow || v < 1 || v > kMaxHolder)
    throw std::invalid_argument(
        (overflow ? std::string("holder id") : "holder id " + std::to_string(v)) +
        " out of range 1.." + std::to_string(kMaxHolder));
  return uint32_t(v);
}

struct Scratch {
  std::vector<Key> keys;
  std::vector<uint32_t> ids;
  std::vector<size_t> out, alive;
  std::vector<uint8_t> added;

  void trim() {
    trim_vector(keys);
    trim_vector(ids);
    trim_vector(out);
    trim_vector(alive);
    trim_vector(added);
  }
};
using ScratchLease = remote_g2::ScratchLease<Scratch>;

// ---------------------------------------------------------------------------

class HolderIndex {
 public:
  // Every call reads all its arguments, in order, before it touches the
  // table: reading may run Python code (an __index__, a generator of
  // hashes) that calls the index again, and that must not see, or break, a
  // half-done change.
  int64_t add(nb::handle holder, nb::handle hashes) {
    uint32_t h = read_holder(holder.ptr());
    ScratchLease scratch;
    read_hash_list(hashes, scratch->keys);
    return table_.add(scratch->keys.data(), scratch->keys.size(), h,
                      scratch->added);
  }

  int64_t remove(nb::handle holder, nb::handle hashes) {
    uint32_t h = read_holder(holder.ptr());
    ScratchLease scratch;
    read_hash_list(hashes, scratch->keys);
    return table_.remove(scratch->keys.data(), scratch->keys.size(), h);
  }

  nb::object holders(nb::handle block_hash) {
    Key k;
    read_hash(block_hash.ptr(), k);
    ScratchLease scratch;
    scratch->ids.clear();
    if (const Slot *s = table_.find(k)) table_.holders(*s, scratch->ids);
    return int_list(scratch->ids.data(), scratch->ids.size());
  }

  nb::object walk(nb::handle hashes, nb::handle candidates) {
    ScratchLease scratch;
    read_hash_list(hashes, scratch->keys);
    if (scratch->keys.empty())
      throw std::invalid_argument("walk: hashes must not be empty");
    read_int_list(candidates, "candidates must be a sequence of int",
                  read_holder, scratch->ids);
    table_.walk(scratch->keys.data(), scratch->keys.size(), scratch->ids.data(),
                scratch->ids.size(), scratch->out, scratch->alive);
    return int_list(scratch->out.data(), scratch->out.size());
  }

  size_t len() const { return table_.size(); }
  int64_t entries() const { return table_.entries(); }
  void clear() { table_.clear(); }

 private:
  Table table_;
};

}  // namespace

NB_MODULE(_holder_index, m) {
  m.doc() = "Private core of remote_g2.holder_index; use HolderIndex from there.";

  m.attr("MAX_HASH_LEN") = int(kMaxHashLen);
  m.attr("MAX_HOLDER") = kMaxHolder;

  nb::class_<HolderIndex>(m, "HolderIndex")
      .def(nb::init<>())
      .def("add", &HolderIndex::add, nb::arg("holder").none(), nb::arg("hashes").none())
      .def("remove", &HolderIndex::remove, nb::arg("holder").none(), nb::arg("hashes").none())
      .def("holders", &HolderIndex::holders, nb::arg("block_hash").none())
      .def("walk", &HolderIndex::walk, nb::arg("hashes").none(), nb::arg("candidates").none())
      .def("__len__", &HolderIndex::len)
      .def_prop_ro("entries", &HolderIndex::entries)
      .def("clear", &HolderIndex::clear);
}
