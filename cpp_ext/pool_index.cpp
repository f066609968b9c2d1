// _pool_index: the private core of remote_g2.memory.pool_index.PoolIndex.
//
// A block hash -> block id index over a fixed pool of `num_blocks` slots, with
// pin counts and LRU eviction of unpinned blocks. The contracts live in the
// Python facade's docstrings; this file says how.
//
// Layout (why): every per-block field is a flat array indexed by block id, so
// one million blocks with 8-byte hashes cost about 40 MB. The hash table is
// open addressing with linear probing over (block id, 32-bit hash) pairs and
// backward-shift deletion: no tombstones pile up under insert/evict churn, and
// most probes are settled by the 32-bit hash without touching the key. Keys
// are compared in full (length + all bytes), so two different hashes never
// share a slot. The LRU list links only blocks that are cached and unpinned:
// a block leaves it when pinned and rejoins at the most-recently-used end when
// its last pin is dropped, so evict(n) is O(n) and never sees a pinned block.
//
// Threading: arguments are copied out of Python objects while the GIL is held;
// then, for calls with real work (see kReleaseGilItems) or when the mutex is
// busy, the GIL is released and one std::mutex serialises access to the core. Nothing under the mutex touches Python, and
// no thread ever waits for the GIL while holding the mutex, so there is no
// lock-order cycle.

#include "block_key.h"

#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace remote_g2;

constexpr int64_t kMaxBlocks = int64_t(1) << 30;
// Calls with at least this many items release the GIL while they work. Below
// it the work (~25 ns per item on a 1M-block pool) is shorter than a GIL
// hand-off between threads: on 2 cores, 2 threads doing 128-hash
// find_and_pin + unpin reached ~180k ops/s (p99 ~100 us) releasing the GIL
// and ~290k ops/s (p99 ~6 us) keeping it; at 2048 hashes keeping it costs
// p99 ~5 ms (the interpreter's switch interval) against ~1 ms releasing it.
// Whatever the size, a call never waits for the mutex while holding the GIL.
constexpr size_t kReleaseGilItems = 1024;

// Raised when an operation would change or free a pinned block; translated to
// remote_g2.errors.BlockPinnedError.
struct BlockPinned : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Evicted {
  int32_t id;
  uint32_t len;
  char bytes[kMaxHashLen];
};

struct Stats {
  int64_t cached, pinned_blocks, total_pins;
  int64_t hits, misses, inserts, evictions, removals;
};

// The index proper. Not thread-safe: the caller holds the mutex. Block ids
// passed in are already range-checked.
class Core {
 public:
  explicit Core(int64_t num_blocks) {
    if (num_blocks < 1 || num_blocks > kMaxBlocks)
      throw std::invalid_argument("num_blocks must be in 1.." +
                                  std::to_string(kMaxBlocks) + ", got " +
                                  std::to_string(num_blocks));
    n_ = int32_t(num_blocks);
    size_t cap = 16;  // power of two, load factor <= 1/2
    while (cap < size_t(2) * size_t(n_)) cap <<= 1;
    mask_ = uint32_t(cap - 1);
    table_.assign(cap, Entry{-1, 0});
    key_lo_.assign(n_, 0);
    key_len_.assign(n_, 0);
    key_h_.assign(n_, 0);
    pins_.assign(n_, 0);
    prev_.assign(size_t(n_) + 1, n_);
    next_.assign(size_t(n_) + 1, n_);  // n_ is the list head: an empty ring
  }

  int32_t num_blocks() const { return n_; }
  int64_t cached() const { return cached_; }
  int32_t pin_count(int32_t id) const { return pins_[id]; }
  int32_t lookup(const Key &k) const { return find(k); }

  Stats stats() const {
    return {cached_, pinned_blocks_, total_pins_, hits_,
            misses_, inserts_,       evictions_,  removals_};
  }

  void insert(const Key &k, int32_t id) {
    check_insert(k, id);
    apply_insert(k, id);
  }

  // Equivalent to insert() of each pair in order, all or nothing. Inserts
  // never change a pinned block or its hash, so checking every pair against
  // the state before the batch is exactly what sequential inserts would check.
  void insert_batch(const Key *keys, const int32_t *ids, size_t count) {
    for (size_t i = 0; i < count; ++i) check_insert(keys[i], ids[i]);
    for (size_t i = 0; i < count; ++i) apply_insert(keys[i], ids[i]);
  }

  // Pins the blocks of the longest present prefix of keys; returns its length.
  size_t find_and_pin(const Key *keys, size_t count, int32_t *out) {
    size_t k = 0;
    for (; k < count; ++k) {
      int32_t s = find(keys[k]);
      if (s < 0) break;
      out[k] = s;
    }
    check_pin_headroom(out, k);
    for (size_t i = 0; i < k; ++i) pin_one(out[i]);
    hits_ += int64_t(k);
    if (k < count) ++misses_;
    return k;
  }

  void pin(const int32_t *ids, size_t count) {
    for (size_t i = 0; i < count; ++i)
      if (key_len_[ids[i]] == 0)
        throw std::invalid_argument("block " + std::to_string(ids[i]) +
                                    " holds no hash and cannot be pinned");
    check_pin_headroom(ids, count);
    for (size_t i = 0; i < count; ++i) pin_one(ids[i]);
  }

  // As if each id were unpinned in order; if one is not pinned at its turn,
  // the ones before it are re-pinned (which restores the LRU list exactly:
  // re-pinning unlinks the blocks that the unpin had linked) and it throws.
  void unpin(const int32_t *ids, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      if (pins_[ids[i]] == 0) {
        int32_t bad = ids[i];
        while (i-- > 0) pin_one(ids[i]);
        throw std::invalid_argument("block " + std::to_string(bad) +
                                    " is not pinned");
      }
      unpin_one(ids[i]);
    }
  }

  void evict(int64_t want, std::vector<Evicted> &out) {
    out.clear();
    while (int64_t(out.size()) < want && next_[n_] != n_) {
      int32_t s = next_[n_];
      Evicted e;
      e.id = s;
      e.len = key_len_[s];
      key_bytes(s, e.bytes);
      out.push_back(e);
      drop(s);
    }
    evictions_ += int64_t(out.size());
  }

  bool remove(const Key &k) {
    int32_t s = find(k);
    if (s < 0 || pins_[s] > 0) return false;
    drop(s);
    ++removals_;
    return true;
  }

 private:
  struct Entry {
    int32_t slot;  // block id, -1 = empty
    uint32_t h;
  };

  int32_t find(const Key &k) const {
    uint32_t h = k.h32();
    for (uint32_t i = h & mask_;; i = (i + 1) & mask_) {
      const Entry &e = table_[i];
      if (e.slot < 0) return -1;
      if (e.h == h && same_key(e.slot, k)) return e.slot;
    }
  }

  bool same_key(int32_t s, const Key &k) const {
    return key_len_[s] == k.len() && key_lo_[s] == k.w[0] &&
           (k.len() <= 8 ||
            std::memcmp(&key_hi_[size_t(3) * s], &k.w[1], 24) == 0);
  }

  void table_add(int32_t s) {
    uint32_t i = key_h_[s] & mask_;
    while (table_[i].slot >= 0) i = (i + 1) & mask_;
    table_[i] = Entry{s, key_h_[s]};
  }

  void table_erase(int32_t s) {
    uint32_t i = key_h_[s] & mask_;
    while (table_[i].slot != s) i = (i + 1) & mask_;
    // Backward shift: pull later entries of the probe run into the hole
    // unless that would move them before their home bucket.
    for (uint32_t j = (i + 1) & mask_; table_[j].slot >= 0;
         j = (j + 1) & mask_) {
      uint32_t home = table_[j].h & mask_;
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        table_[i] = table_[j];
        i = j;
      }
    }
    table_[i].slot = -1;
  }

  void lru_unlink(int32_t s) {
    next_[prev_[s]] = next_[s];
    prev_[next_[s]] = prev_[s];
  }

  void lru_push_mru(int32_t s) {
    int32_t last = prev_[n_];
    next_[last] = s;
    prev_[s] = last;
    next_[s] = n_;
    prev_[n_] = s;
  }

  void key_bytes(int32_t s, char *out) const {
    uint32_t len = key_len_[s];
    std::memcpy(out, &key_lo_[s], len < 8 ? len : 8);
    if (len > 8) std::memcpy(out + 8, &key_hi_[size_t(3) * s], len - 8);
  }

  // Frees a cached, unpinned block.
  void drop(int32_t s) {
    table_erase(s);
    lru_unlink(s);
    key_len_[s] = 0;
    --cached_;
  }

  void pin_one(int32_t s) {
    if (pins_[s]++ == 0) {
      lru_unlink(s);
      ++pinned_blocks_;
    }
    ++total_pins_;
  }

  void unpin_one(int32_t s) {
    if (--pins_[s] == 0) {
      lru_push_mru(s);
      --pinned_blocks_;
    }
    --total_pins_;
  }

  // Pin counts are 32-bit; refuse (before changing anything) a call that
  // could push one past INT32_MAX, counting every id in the call as a
  // possible duplicate.
  void check_pin_headroom(const int32_t *ids, size_t count) const {
    if (count == 0) return;
    int64_t room = int64_t(INT32_MAX) - int64_t(count);
    for (size_t i = 0; i < count; ++i)
      if (int64_t(pins_[ids[i]]) > room)
        throw std::overflow_error("pin count of block " +
                                  std::to_string(ids[i]) + " would overflow");
  }

  void check_insert(const Key &k, int32_t id) const {
    if (pins_[id] > 0)
      throw BlockPinned("block " + std::to_string(id) +
                        " is pinned; cannot insert over it");
    int32_t old = find(k);
    if (old >= 0 && pins_[old] > 0)  // old != id here, since id is unpinned
      throw BlockPinned("the hash is cached in pinned block " +
                        std::to_string(old) + "; cannot move it to block " +
                        std::to_string(id));
  }

  void apply_insert(const Key &k, int32_t id) {
    // Allocate the long-key words first so a bad_alloc changes nothing.
    if (k.len() > 8 && key_hi_.empty()) key_hi_.assign(size_t(3) * n_, 0);
    ++inserts_;
    int32_t old = find(k);
    if (old == id) {  // already there: just refresh its LRU position
      lru_unlink(id);
      lru_push_mru(id);
      return;
    }
    if (old >= 0) drop(old);
    if (key_len_[id] != 0) drop(id);
    key_lo_[id] = k.w[0];
    key_len_[id] = uint8_t(k.len());
    key_h_[id] = k.h32();
    if (k.len() > 8) std::memcpy(&key_hi_[size_t(3) * id], &k.w[1], 24);
    table_add(id);
    lru_push_mru(id);
    ++cached_;
  }

  int32_t n_ = 0;
  uint32_t mask_ = 0;
  std::vector<Entry> table_;
  std::vector<uint64_t> key_lo_;   // first 8 bytes of the hash, zero-padded
  std::vector<uint8_t> key_len_;   // 0: the block holds no hash
  std::vector<uint32_t> key_h_;    // table hash, for erase without rehashing
  std::vector<uint64_t> key_hi_;   // bytes 8..31, 3 words per block; allocated
                                   // when the first hash longer than 8 arrives
  std::vector<int32_t> pins_;
  std::vector<int32_t> prev_, next_;  // LRU ring; index n_ is the head,
                                      // next_[n_] the least recently used
  int64_t cached_ = 0, pinned_blocks_ = 0, total_pins_ = 0;
  int64_t hits_ = 0, misses_ = 0, inserts_ = 0, evictions_ = 0, removals_ = 0;
};

// ---------------------------------------------------------------------------
// Reading arguments (GIL held). Items are validated in order; the first bad
// one raises TypeError (wrong type), ValueError (hash length) or IndexError
// (block id out of range).

int32_t read_id(PyObject *o, int32_t n) {
  int overflow;
  long long v = read_long_long(o, overflow);  // TypeError for a non-int
  if (overflow || v < 0 || v >= n)
    throw std::out_of_range(
        (overflow ? std::string("block id") : "block id " + std::to_string(v)) +
        " out of range for a pool of " + std::to_string(n) + " blocks");
  return int32_t(v);
}

void read_id_list(nb::handle seq, int32_t nblocks, std::vector<int32_t> &ids) {
  read_int_list(seq, "block ids must be a sequence of int",
                [&](PyObject *o) { return read_id(o, nblocks); }, ids);
}

size_t check_hash_len(int64_t hash_len) {
  if (hash_len < 1 || hash_len > kMaxHashLen)
    throw std::invalid_argument("hash_len must be 1..32, got " +
                                std::to_string(hash_len));
  return size_t(hash_len);
}

// n*hash_len bytes of any C-contiguous bytes-like object -> n keys.
void read_packed_hashes(nb::handle buf, int64_t hash_len, std::vector<Key> &keys) {
  size_t hl = check_hash_len(hash_len);
  Buffer b(buf.ptr(), PyBUF_SIMPLE);
  size_t nbytes = size_t(b.view.len);
  if (nbytes % hl != 0)
    throw std::invalid_argument("packed hashes: " + std::to_string(nbytes) +
                                " bytes is not a multiple of hash_len " +
                                std::to_string(hl));
  size_t n = nbytes / hl;
  const char *p = static_cast<const char *>(b.view.buf);
  keys.resize(n);
  if (hl == 8) {  // the u64 (TensorRT-LLM / Dynamo) case: a constant-size copy
    for (size_t i = 0; i < n; ++i) make_key(p + 8 * i, 8, keys[i]);
  } else {
    for (size_t i = 0; i < n; ++i) make_key(p + hl * i, hl, keys[i]);
  }
}

// A 1-D int32 or int64 array (numpy or any buffer exporter) -> range-checked ids.
void read_packed_ids(nb::handle arr, int32_t nblocks, std::vector<int32_t> &ids) {
  Buffer b(arr.ptr(), PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
  const char *fmt = b.view.format ? b.view.format : "B";
  if (*fmt == '@' || *fmt == '=') ++fmt;
  char code = (fmt[0] != '\0' && fmt[1] == '\0') ? fmt[0] : '?';
  Py_ssize_t size = b.view.itemsize;
  bool is32 = size == 4 && (code == 'i' || code == 'l');
  bool is64 = size == 8 && (code == 'l' || code == 'q');
  if (b.view.ndim != 1 || !(is32 || is64))
    throw nb::type_error(("block ids must be a 1-D int32 or int64 array, got "
                          "format '" + std::string(b.view.format ? b.view.format : "B") +
                          "' with ndim " + std::to_string(b.view.ndim))
                             .c_str());
  size_t n = size_t(b.view.shape[0]);
  ids.resize(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t v = is32 ? int64_t(static_cast<const int32_t *>(b.view.buf)[i])
                     : static_cast<const int64_t *>(b.view.buf)[i];
    if (v < 0 || v >= nblocks)
      throw std::out_of_range("block id " + std::to_string(v) +
                              " out of range for a pool of " +
                              std::to_string(nblocks) + " blocks");
    ids[i] = int32_t(v);
  }
}

struct Scratch {
  std::vector<Key> keys;
  std::vector<int32_t> ids, out;

  void trim() {
    trim_vector(keys);
    trim_vector(ids);
    trim_vector(out);
  }
};
using ScratchLease = remote_g2::ScratchLease<Scratch>;

PyObject *g_numpy_empty = nullptr;  // numpy.empty, looked up once, never freed
PyObject *g_int32 = nullptr;        // "int32"

// A new numpy int32 array holding ids[0:n].
nb::object numpy_int32(const int32_t *ids, size_t n) {
  if (!g_numpy_empty) {
    nb::object np = nb::module_::import_("numpy");
    g_numpy_empty = nb::object(np.attr("empty")).release().ptr();
    g_int32 = nb::str("int32").release().ptr();
  }
  PyObject *args[2] = {nullptr, nullptr};
  nb::object len = nb::steal(PyLong_FromSize_t(n));
  if (!len.is_valid()) raise_python();
  args[0] = len.ptr();
  args[1] = g_int32;
  nb::object arr = nb::steal(PyObject_Vectorcall(g_numpy_empty, args, 2, nullptr));
  if (!arr.is_valid()) raise_python();
  if (n > 0) {
    Buffer b(arr.ptr(), PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
    std::memcpy(b.view.buf, ids, n * sizeof(int32_t));
  }
  return arr;
}

// ---------------------------------------------------------------------------

class PoolIndex {
 public:
  explicit PoolIndex(int64_t num_blocks) : core_(num_blocks) {}

  int32_t num_blocks() const { return core_.num_blocks(); }

  void insert(nb::handle block_hash, nb::handle block_id) {
    Key k;
    read_hash(block_hash.ptr(), k);
    int32_t id = read_id(block_id.ptr(), core_.num_blocks());
    locked(false, [&] { core_.insert(k, id); });
  }

  void insert_packed(nb::handle buf, nb::handle ids, int64_t hash_len) {
    ScratchLease scratch;
    std::vector<Key> &keys = scratch->keys;
    std::vector<int32_t> &idv = scratch->ids;
    read_packed_hashes(buf, hash_len, keys);
    read_packed_ids(ids, core_.num_blocks(), idv);
    if (keys.size() != idv.size())
      throw std::invalid_argument(std::to_string(keys.size()) + " hashes but " +
                                  std::to_string(idv.size()) + " block ids");
    locked(keys.size() >= kReleaseGilItems,
           [&] { core_.insert_batch(keys.data(), idv.data(), keys.size()); });
  }

  nb::object find_and_pin(nb::handle hashes) {
    ScratchLease scratch;
    read_hash_list(hashes, scratch->keys);
    size_t k = find_and_pin_keys(scratch->keys, scratch->out);
    const int32_t *ids = scratch->out.data();
    return built_or_unpinned(ids, k, [&] { return int_list(ids, k); });
  }

  nb::object find_and_pin_packed(nb::handle buf, int64_t hash_len) {
    ScratchLease scratch;
    read_packed_hashes(buf, hash_len, scratch->keys);
    size_t k = find_and_pin_keys(scratch->keys, scratch->out);
    const int32_t *ids = scratch->out.data();
    return built_or_unpinned(ids, k, [&] { return numpy_int32(ids, k); });
  }

  void pin_blocks_by_id(nb::handle ids) {
    ScratchLease scratch;
    read_id_list(ids, core_.num_blocks(), scratch->ids);
    pin_ids(scratch->ids);
  }

  void unpin_blocks_by_id(nb::handle ids) {
    ScratchLease scratch;
    read_id_list(ids, core_.num_blocks(), scratch->ids);
    unpin_ids(scratch->ids);
  }

  void pin_packed(nb::handle ids) {
    ScratchLease scratch;
    read_packed_ids(ids, core_.num_blocks(), scratch->ids);
    pin_ids(scratch->ids);
  }

  void unpin_packed(nb::handle ids) {
    ScratchLease scratch;
    read_packed_ids(ids, core_.num_blocks(), scratch->ids);
    unpin_ids(scratch->ids);
  }

  nb::object evict(nb::handle n_obj) {
    int overflow;
    long long n = read_long_long(n_obj.ptr(), overflow);
    if (overflow < 0 || (!overflow && n < 0))
      throw std::invalid_argument("evict: n must be >= 0");
    if (overflow > 0) n = LLONG_MAX;
    std::vector<Evicted> out;
    locked(n >= int64_t(kReleaseGilItems), [&] { core_.evict(n, out); });
    PyObject *list = PyList_New(Py_ssize_t(out.size()));
    if (!list) raise_python();
    nb::object guard = nb::steal(list);
    for (size_t i = 0; i < out.size(); ++i) {
      nb::object h = nb::steal(
          PyBytes_FromStringAndSize(out[i].bytes, Py_ssize_t(out[i].len)));
      nb::object id = nb::steal(PyLong_FromLong(out[i].id));
      if (!h.is_valid() || !id.is_valid()) raise_python();
      PyObject *t = PyTuple_Pack(2, h.ptr(), id.ptr());
      if (!t) raise_python();
      PyList_SET_ITEM(list, Py_ssize_t(i), t);
    }
    return guard;
  }

  bool remove(nb::handle block_hash) {
    Key k;
    read_hash(block_hash.ptr(), k);
    return locked(false, [&] { return core_.remove(k); });
  }

  nb::object lookup(nb::handle block_hash) {
    Key k;
    read_hash(block_hash.ptr(), k);
    int32_t s = locked(false, [&] { return core_.lookup(k); });
    if (s < 0) return nb::none();
    return nb::int_(s);
  }

  int32_t pin_count(nb::handle block_id) {
    int32_t id = read_id(block_id.ptr(), core_.num_blocks());
    return locked(false, [&] { return core_.pin_count(id); });
  }

  int64_t len() {
    return locked(false, [&] { return core_.cached(); });
  }

  nb::dict stats() {
    Stats s = locked(false, [&] { return core_.stats(); });
    nb::dict d;
    d["num_blocks"] = core_.num_blocks();
    d["cached"] = s.cached;
    d["pinned_blocks"] = s.pinned_blocks;
    d["total_pins"] = s.total_pins;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["inserts"] = s.inserts;
    d["evictions"] = s.evictions;
    d["removals"] = s.removals;
    return d;
  }

 private:
  // Runs f under the mutex. Small calls keep the GIL when the mutex is free
  // (the common case); otherwise the GIL is released before waiting, so a
  // thread blocked on the mutex never blocks Python.
  template <class F>
  auto locked(bool release_gil, F &&f) -> decltype(f()) {
    if (!release_gil && mu_.try_lock()) {
      std::lock_guard<std::mutex> guard(mu_, std::adopt_lock);
      return f();
    }
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> guard(mu_);
    return f();
  }

  size_t find_and_pin_keys(const std::vector<Key> &keys, std::vector<int32_t> &out) {
    out.resize(keys.size());
    return locked(keys.size() >= kReleaseGilItems, [&] {
      return core_.find_and_pin(keys.data(), keys.size(), out.data());
    });
  }

  // Builds the result of a find_and_pin; if that fails (out of memory), the
  // pins just taken are dropped again so they do not leak.
  template <class Build>
  nb::object built_or_unpinned(const int32_t *ids, size_t k, Build &&build) {
    try {
      return build();
    } catch (...) {
      locked(true, [&] { core_.unpin(ids, k); });
      throw;
    }
  }

  void pin_ids(const std::vector<int32_t> &ids) {
    locked(ids.size() >= kReleaseGilItems,
           [&] { core_.pin(ids.data(), ids.size()); });
  }

  void unpin_ids(const std::vector<int32_t> &ids) {
    locked(ids.size() >= kReleaseGilItems,
           [&] { core_.unpin(ids.data(), ids.size()); });
  }

  Core core_;
  std::mutex mu_;
};

}  // namespace

NB_MODULE(_pool_index, m) {
  m.doc() = "Private core of remote_g2.memory.pool_index; use PoolIndex from there.";

  // BlockPinned -> remote_g2.errors.BlockPinnedError (a ValueError), so the
  // facade raises the project's class without a try/except on every call.
  nb::object pinned_error =
      nb::module_::import_("remote_g2.errors").attr("BlockPinnedError");
  if (!PyExceptionClass_Check(pinned_error.ptr()))
    throw std::runtime_error("remote_g2.errors.BlockPinnedError is not an exception class");
  nb::register_exception_translator(
      [](const std::exception_ptr &p, void *payload) {
        try {
          std::rethrow_exception(p);
        } catch (const BlockPinned &e) {
          PyErr_SetString(static_cast<PyObject *>(payload), e.what());
        }
      },
      pinned_error.release().ptr());  // kept alive for the process

  m.attr("MAX_HASH_LEN") = int(kMaxHashLen);
  m.attr("MAX_BLOCKS") = kMaxBlocks;

  nb::class_<PoolIndex>(m, "PoolIndex")
      .def(nb::init<int64_t>(), nb::arg("num_blocks"))
      .def_prop_ro("num_blocks", &PoolIndex::num_blocks)
      .def("insert", &PoolIndex::insert, nb::arg("block_hash").none(), nb::arg("block_id").none())
      .def("insert_packed", &PoolIndex::insert_packed, nb::arg("buf").none(),
           nb::arg("ids").none(), nb::arg("hash_len"))
      .def("find_and_pin", &PoolIndex::find_and_pin, nb::arg("hashes").none())
      .def("find_and_pin_packed", &PoolIndex::find_and_pin_packed,
           nb::arg("buf").none(), nb::arg("hash_len"))
      .def("pin_blocks_by_id", &PoolIndex::pin_blocks_by_id, nb::arg("ids").none())
      .def("unpin_blocks_by_id", &PoolIndex::unpin_blocks_by_id, nb::arg("ids").none())
      .def("pin_packed", &PoolIndex::pin_packed, nb::arg("ids").none())
      .def("unpin_packed", &PoolIndex::unpin_packed, nb::arg("ids").none())
      .def("evict", &PoolIndex::evict, nb::arg("n").none())
      .def("remove", &PoolIndex::remove, nb::arg("block_hash").none())
      .def("lookup", &PoolIndex::lookup, nb::arg("block_hash").none())
      .def("pin_count", &PoolIndex::pin_count, nb::arg("block_id").none())
      .def("__len__", &PoolIndex::len)
      .def("stats", &PoolIndex::stats);
}
