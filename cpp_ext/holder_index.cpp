// _holder_index: the private core of remote_g2.registry.stores.holder_index.HolderIndex.
//
// A block hash -> set of holder ids (uint32, 1..2**32-1) table for the
// registry's prefix lookups. The contracts live in the Python facade's
// docstrings; this file says how.
//
// Layout (why): a lookup walks up to 128 hashes of a chain and, for each,
// asks whether one or two candidate holders still hold it; a registry mirror
// keeps the whole fleet's hashes (tens of millions) in every process that
// follows it. So a slot must be small and a probe must touch one cache line.
// A 16-byte Slot holds a 64-bit fingerprint of the hash and up to two holder
// ids; four slots share a line. Most hashes have one or two holders; a hash
// with more keeps them all in a sorted overflow array (one more line).
//
// Fingerprints, not keys (why): storing the 32-byte key would triple the
// slot. The fingerprint is a keyed mix of the whole key and its length, with
// a random key per table, so no caller can build two hashes that collide on
// purpose; two different hashes share a fingerprint with probability ~2^-62.
// A collision can only make the index name a holder for a hash it does not
// hold, and every reader treats the index as a hint: the source pins by the
// full hash on resolve and answers with what it really holds, so the cost is
// a miss, never a wrong block.
//
// Open addressing with linear probing: the next slot of a run is usually on
// the same line. Load stays in 0.4..0.8 (grow x2 beyond 0.8): 20..40 bytes
// per hash. Deletion is backward-shift, so remove/add churn leaves no
// tombstones to lengthen runs. The table never shrinks (clear() frees it):
// the registry's holder set grows and shrinks with the fleet, and a rehash on
// the way down would stall a lookup for no lasting gain.
//
// Threading: none of its own. Every call keeps the GIL for its whole run and
// runs no Python code between reading its arguments and finishing with the
// table, so calls are atomic with respect to each other; the registry
// serialises them with its own lock anyway. Calls are a few µs (drop_holder,
// a scan of the whole table, is milliseconds): releasing the GIL would cost
// more than it frees.

#include "block_key.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace remote_g2;

constexpr long long kMaxHolder = 0xffffffffLL;
// How many hashes ahead walk() prefetches: the probes of a chain are
// independent, so their misses can overlap instead of queueing one by one.
constexpr size_t kPrefetchAhead = 8;

constexpr uint64_t kMany = 1;  // tag bit 0: the holders are in overflow_[a]
constexpr uint64_t kUsed = 2;  // tag bit 1: always set in a used slot's tag

struct Slot {
  uint64_t tag;  // fingerprint | kUsed (| kMany); 0 = empty
  uint32_t a;    // the first holder; with kMany, the index into overflow_
  uint32_t b;    // the second holder, 0 = none; unused with kMany
};
static_assert(sizeof(Slot) == 16, "four slots, one cache line");

// The keyed fingerprint of a key (words chained through fmix64, so without
// the seed no difference between two keys can be made to cancel out).
inline uint64_t fingerprint(const Key &k, const uint64_t seed[2]) {
  uint64_t h = fmix64(seed[0] ^ k.w[0] ^ (uint64_t(k.len()) * 0x9e3779b97f4a7c15ULL));
  if (k.len() > 8) {
    h = fmix64(h ^ k.w[1] ^ seed[1]);
    if (k.len() > 16) h = fmix64(fmix64(h ^ k.w[2]) ^ k.w[3]);
  }
  return (h & ~kMany) | kUsed;
}

class Table {
 public:
  Table() : slots_(kMinSlots), mask_(kMinSlots - 1) {
    std::random_device rd;
    for (uint64_t &s : seed_) s = (uint64_t(rd()) << 32) ^ rd();
  }

  size_t size() const { return size_; }
  int64_t entries() const { return entries_; }
  size_t bytes() const {
    size_t n = slots_.capacity() * sizeof(Slot) + overflow_.capacity() * sizeof(overflow_[0]) +
               free_.capacity() * sizeof(uint32_t);
    for (const std::vector<uint32_t> &v : overflow_) n += v.capacity() * sizeof(uint32_t);
    return n;
  }

  uint64_t tag_of(const Key &k) const { return fingerprint(k, seed_); }

  const Slot *find(uint64_t tag) const {
    for (size_t i = home(tag);; i = (i + 1) & mask_) {
      const Slot &s = slots_[i];
      if (s.tag == 0) return nullptr;
      if (same(s, tag)) return &s;
    }
  }

  void prefetch(uint64_t tag) const { __builtin_prefetch(&slots_[home(tag)]); }

  bool holds(const Slot &s, uint32_t holder) const {
    if (!(s.tag & kMany)) return s.a == holder || s.b == holder;
    const std::vector<uint32_t> &v = overflow_[s.a];
    return std::binary_search(v.begin(), v.end(), holder);
  }

  // The holders of s, sorted ascending.
  void holders(const Slot &s, std::vector<uint32_t> &out) const {
    if (s.tag & kMany) {
      out = overflow_[s.a];
      return;
    }
    out.clear();
    out.push_back(s.a);
    if (s.b) out.insert(s.b < s.a ? out.begin() : out.end(), s.b);
  }

  // Adds holder to each tag; returns how many pairs were new. All or
  // nothing: the only failure is bad_alloc, and then the pairs added so far
  // are removed again (`added` is caller-owned scratch for that).
  int64_t add(const uint64_t *tags, size_t n, uint32_t holder,
              std::vector<uint8_t> &added) {
    added.assign(n, 0);
    // Grow once, before any change, so no insert below can need to. Only
    // when the batch might not fit is it worth probing for the absent keys
    // (a repeat counts twice: an upper bound is enough).
    if (!fits(size_ + n)) {
      size_t absent = 0;
      for (size_t i = 0; i < n; ++i) absent += find(tags[i]) == nullptr;
      grow_to_fit(size_ + absent);
    }
    int64_t fresh = 0;
    size_t i = 0;
    try {
      for (; i < n; ++i) {
        added[i] = add_one(tags[i], holder);
        fresh += added[i];
      }
    } catch (...) {
      while (i-- > 0)
        if (added[i]) remove_one(tags[i], holder);
      throw;
    }
    return fresh;
  }

  // Removes holder from each tag; returns how many pairs existed.
  int64_t remove(const uint64_t *tags, size_t n, uint32_t holder) noexcept {
    int64_t gone = 0;
    for (size_t i = 0; i < n; ++i) gone += remove_one(tags[i], holder);
    return gone;
  }

  // Removes holder from every hash: one pass over the whole table. A slot
  // emptied at i is refilled by the backward shift from later in its run, so
  // i is looked at again; what wraps around from the table's start was
  // already seen, and looking at it again removes nothing twice.
  int64_t drop_holder(uint32_t holder) noexcept {
    int64_t gone = 0;
    for (size_t i = 0; i < slots_.size();) {
      Slot &s = slots_[i];
      if (s.tag != 0 && holds(s, holder)) {
        gone += 1;
        if (drop_from(i, holder)) continue;  // emptied: look at i again
      }
      ++i;
    }
    return gone;
  }

  // out[j] = 1 + the number of consecutive tags from tags[1] that
  // cands[j] holds; tags[0] is taken as held. `alive` is scratch.
  //
  // The candidates still in the walk are kept sorted by holder id, so a
  // hash with many holders (a sorted overflow array) is checked against
  // all of them in one merge, not a binary search per candidate: a prefix
  // most of a fleet holds is the scoring API's usual case.
  void walk(const uint64_t *tags, size_t n, const uint32_t *cands, size_t m,
            std::vector<size_t> &out, std::vector<size_t> &alive) const {
    out.assign(m, n);
    alive.resize(m);
    for (size_t j = 0; j < m; ++j) alive[j] = j;
    std::sort(alive.begin(), alive.end(), [cands](size_t x, size_t y) { return cands[x] < cands[y]; });
    for (size_t i = 1; i < std::min(n, 1 + kPrefetchAhead); ++i)
      prefetch(tags[i]);
    size_t live = m;
    for (size_t i = 1; i < n && live > 0; ++i) {
      if (i + kPrefetchAhead < n) prefetch(tags[i + kPrefetchAhead]);
      const Slot *s = find(tags[i]);
      size_t kept = 0;
      if (s && (s->tag & kMany)) {
        const std::vector<uint32_t> &v = overflow_[s->a];
        size_t k = 0;
        for (size_t a = 0; a < live; ++a) {
          size_t j = alive[a];
          while (k < v.size() && v[k] < cands[j]) ++k;
          if (k < v.size() && v[k] == cands[j])
            alive[kept++] = j;
          else
            out[j] = i;
        }
      } else {
        for (size_t a = 0; a < live; ++a) {
          size_t j = alive[a];
          if (s && (s->a == cands[j] || s->b == cands[j]))
            alive[kept++] = j;
          else
            out[j] = i;
        }
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

  static bool same(const Slot &s, uint64_t tag) { return (s.tag | kMany) == (tag | kMany); }

  bool fits(size_t hashes) const { return hashes * 10 <= slots_.size() * 8; }

  void grow_to_fit(size_t hashes) {
    size_t cap = slots_.size();
    while (hashes * 10 > cap * 8) cap <<= 1;
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
  bool add_one(uint64_t tag, uint32_t holder) {
    size_t i = home(tag);
    for (; slots_[i].tag != 0; i = (i + 1) & mask_) {
      Slot &s = slots_[i];
      if (!same(s, tag)) continue;
      if (holds(s, holder)) return false;
      if (s.tag & kMany) {
        std::vector<uint32_t> &v = overflow_[s.a];
        v.insert(std::upper_bound(v.begin(), v.end(), holder), holder);
      } else if (s.b == 0) {
        s.b = holder;
      } else {
        uint32_t lo = std::min(s.a, s.b), hi = std::max(s.a, s.b);
        uint32_t third[3] = {lo, hi, holder};
        std::sort(third, third + 3);
        s.a = new_overflow(third, third + 3);
        s.tag |= kMany;
      }
      ++entries_;
      return true;
    }
    slots_[i] = Slot{tag, holder, 0};
    ++size_;
    ++entries_;
    return true;
  }

  bool remove_one(uint64_t tag, uint32_t holder) noexcept {
    size_t i = home(tag);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].tag == 0) return false;
      if (same(slots_[i], tag)) break;
    }
    if (!holds(slots_[i], holder)) return false;
    drop_from(i, holder);
    return true;
  }

  // Removes holder (which slot i holds) from slot i; true when that emptied
  // the slot (and the backward shift may have moved another hash into i).
  bool drop_from(size_t i, uint32_t holder) noexcept {
    Slot &s = slots_[i];
    --entries_;
    if (s.tag & kMany) {
      std::vector<uint32_t> &v = overflow_[s.a];
      v.erase(std::lower_bound(v.begin(), v.end(), holder));
      if (v.size() == 2) {  // back inline
        uint32_t at = s.a;
        s.a = v[0];
        s.b = v[1];
        s.tag &= ~kMany;
        free_overflow(at);
      }
      return false;
    }
    if (s.a == holder) {
      s.a = s.b;
      s.b = 0;
    } else {
      s.b = 0;
    }
    if (s.a != 0) return false;
    erase_slot(i);
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

  // An overflow array holding [first, last) (sorted); throws before any change.
  uint32_t new_overflow(const uint32_t *first, const uint32_t *last) {
    std::vector<uint32_t> v(first, last);
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
  std::vector<std::vector<uint32_t>> overflow_;  // holders of kMany slots, sorted
  std::vector<uint32_t> free_;                   // unused overflow_ indices
  size_t size_ = 0;                              // occupied slots (hashes)
  int64_t entries_ = 0;                          // (hash, holder) pairs
  uint64_t seed_[2];                             // the fingerprint key
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
  std::vector<uint64_t> tags;
  std::vector<uint32_t> ids;
  std::vector<size_t> out, alive;
  std::vector<uint8_t> added;

  void trim() {
    trim_vector(keys);
    trim_vector(tags);
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
    read_tags(hashes, *scratch);
    return table_.add(scratch->tags.data(), scratch->tags.size(), h,
                      scratch->added);
  }

  int64_t remove(nb::handle holder, nb::handle hashes) {
    uint32_t h = read_holder(holder.ptr());
    ScratchLease scratch;
    read_tags(hashes, *scratch);
    return table_.remove(scratch->tags.data(), scratch->tags.size(), h);
  }

  int64_t drop_holder(nb::handle holder) {
    return table_.drop_holder(read_holder(holder.ptr()));
  }

  nb::object holders(nb::handle block_hash) {
    Key k;
    read_hash(block_hash.ptr(), k);
    ScratchLease scratch;
    scratch->ids.clear();
    if (const Slot *s = table_.find(table_.tag_of(k)))
      table_.holders(*s, scratch->ids);
    return int_list(scratch->ids.data(), scratch->ids.size());
  }

  nb::object walk(nb::handle hashes, nb::handle candidates) {
    ScratchLease scratch;
    read_tags(hashes, *scratch);
    if (scratch->tags.empty())
      throw std::invalid_argument("walk: hashes must not be empty");
    read_int_list(candidates, "candidates must be a sequence of int",
                  read_holder, scratch->ids);
    table_.walk(scratch->tags.data(), scratch->tags.size(), scratch->ids.data(),
                scratch->ids.size(), scratch->out, scratch->alive);
    return int_list(scratch->out.data(), scratch->out.size());
  }

  size_t len() const { return table_.size(); }
  int64_t entries() const { return table_.entries(); }
  size_t bytes() const { return table_.bytes(); }
  void clear() { table_.clear(); }

 private:
  // The hashes' fingerprints into s.tags (every hash validated first).
  void read_tags(nb::handle hashes, Scratch &s) const {
    read_hash_list(hashes, s.keys);
    s.tags.resize(s.keys.size());
    for (size_t i = 0; i < s.keys.size(); ++i) s.tags[i] = table_.tag_of(s.keys[i]);
  }

  Table table_;
};

}  // namespace

NB_MODULE(_holder_index, m) {
  m.doc() = "Private core of remote_g2.registry.stores.holder_index; use HolderIndex from there.";

  m.attr("MAX_HASH_LEN") = int(kMaxHashLen);
  m.attr("MAX_HOLDER") = kMaxHolder;

  nb::class_<HolderIndex>(m, "HolderIndex")
      .def(nb::init<>())
      .def("add", &HolderIndex::add, nb::arg("holder").none(), nb::arg("hashes").none())
      .def("remove", &HolderIndex::remove, nb::arg("holder").none(), nb::arg("hashes").none())
      .def("holders", &HolderIndex::holders, nb::arg("block_hash").none())
      .def("walk", &HolderIndex::walk, nb::arg("hashes").none(), nb::arg("candidates").none())
      .def("drop_holder", &HolderIndex::drop_holder, nb::arg("holder").none())
      .def("__len__", &HolderIndex::len)
      .def_prop_ro("nbytes", &HolderIndex::bytes)
      .def_prop_ro("entries", &HolderIndex::entries)
      .def("clear", &HolderIndex::clear);
}
