// block_key.h: what the C++ indexes (_pool_index, _holder_index) share —
// block-hash keys and reading arguments out of Python objects.
//
// Every function here runs with the GIL held. Each extension is its own
// shared library built with hidden visibility, so the inline definitions do
// not clash between them.

#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace nb = nanobind;

namespace remote_g2 {

constexpr Py_ssize_t kMaxHashLen = 32;

// A block hash copied out of Python: zero-padded words (so equality is a few
// word compares) and a tag. The tag is 58 bits of the key's hash with the
// length (1..32) in the low 6 bits: comparing tags compares lengths too (so
// b"\0" != b"\0\0"), and an occupied slot's tag is never 0.
struct Key {
  uint64_t w[4];
  uint64_t tag;

  uint32_t len() const { return uint32_t(tag & 63); }
  uint32_t h32() const { return uint32_t(tag >> 32); }  // a 32-bit table hash
};

inline uint64_t fmix64(uint64_t x) {  // murmur3 finaliser: full avalanche
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// `len` must already be checked to be in 1..32.
inline void make_key(const char *data, size_t len, Key &k) {
  k.w[0] = k.w[1] = k.w[2] = k.w[3] = 0;
  std::memcpy(k.w, data, len);
  uint64_t h = fmix64(k.w[0] ^ (uint64_t(len) * 0x9e3779b97f4a7c15ULL));
  if (len > 8) h = fmix64(h ^ k.w[1] ^ fmix64(k.w[2] ^ fmix64(k.w[3])));
  k.tag = (h & ~uint64_t(63)) | uint64_t(len);
}

// ---------------------------------------------------------------------------
// Reading arguments. Items are validated in order; the first bad one raises.

[[noreturn]] inline void raise_python() { throw nb::python_error(); }

struct Buffer {  // a PyObject_GetBuffer view, released on scope exit
  Py_buffer view{};
  Buffer(PyObject *o, int flags) {
    if (PyObject_GetBuffer(o, &view, flags) != 0) raise_python();
  }
  ~Buffer() { PyBuffer_Release(&view); }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
};

// TypeError (not bytes) or ValueError (length not in 1..32).
inline void read_hash(PyObject *o, Key &k) {
  if (!PyBytes_Check(o))
    throw nb::type_error((std::string("block hash must be bytes, not ") +
                          Py_TYPE(o)->tp_name)
                             .c_str());
  Py_ssize_t len = PyBytes_GET_SIZE(o);
  if (len < 1 || len > kMaxHashLen)
    throw std::invalid_argument("block hash must be 1..32 bytes, got " +
                                std::to_string(len));
  make_key(PyBytes_AS_STRING(o), size_t(len), k);
}

// o as a long long through __index__ (TypeError for a non-int); `overflow` is
// set to +1/-1 when it does not fit.
inline long long read_long_long(PyObject *o, int &overflow) {
  overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (v == -1 && !overflow && PyErr_Occurred()) raise_python();
  return v;
}

// PySequence_Fast keeps lists and tuples as they are (no copy).
inline nb::object as_fast_sequence(nb::handle seq, const char *what) {
  PyObject *fast = PySequence_Fast(seq.ptr(), what);
  if (!fast) raise_python();
  return nb::steal(fast);
}

// Reading bytes objects runs no Python code, so the item array stays valid.
inline void read_hash_list(nb::handle seq, std::vector<Key> &keys) {
  nb::object fast =
      as_fast_sequence(seq, "block hashes must be a sequence of bytes");
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject **items = PySequence_Fast_ITEMS(fast.ptr());
  keys.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) read_hash(items[i], keys[size_t(i)]);
}

// A sequence of ints, each converted (and range-checked) by read(PyObject *).
// A non-int's __index__ runs Python code that may change the list: re-read
// the size every time and hold a reference to the item being converted.
template <class T, class Read>
void read_int_list(nb::handle seq, const char *what, Read &&read,
                   std::vector<T> &out) {
  nb::object fast = as_fast_sequence(seq, what);
  out.clear();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast.ptr()); ++i) {
    nb::object item = nb::borrow(PySequence_Fast_GET_ITEM(fast.ptr(), i));
    out.push_back(read(item.ptr()));
  }
}

// A new list of Python ints holding v[0:n].
template <class T>
nb::object int_list(const T *v, size_t n) {
  PyObject *list = PyList_New(Py_ssize_t(n));
  if (!list) raise_python();
  nb::object guard = nb::steal(list);
  for (size_t i = 0; i < n; ++i) {
    PyObject *x = PyLong_FromLongLong((long long)v[i]);
    if (!x) raise_python();
    PyList_SET_ITEM(list, Py_ssize_t(i), x);
  }
  return guard;
}

// ---------------------------------------------------------------------------
// Per-thread buffers for copied-out arguments and results, reused across
// calls so the hot path does not allocate. A call can re-enter on the same
// thread (a non-int id's __index__, or a generator of hashes, runs Python code
// that may call an index again); the nested call then gets fresh buffers.
// S has a trim() that gives memory back after a bulk call.

template <class T>
void trim_vector(std::vector<T> &v) {
  // A 1M-hash fill would otherwise keep ~40 MB per thread for good.
  constexpr size_t kKeep = size_t(1) << 16;
  if (v.capacity() > kKeep) std::vector<T>().swap(v);
}

template <class S>
class ScratchLease {
 public:
  ScratchLease() : s_(busy() ? &own_ : &shared()), owner_(!busy()) {
    busy() = true;
  }
  ~ScratchLease() {
    if (!owner_) return;
    s_->trim();
    busy() = false;
  }
  ScratchLease(const ScratchLease &) = delete;
  ScratchLease &operator=(const ScratchLease &) = delete;
  S *operator->() { return s_; }
  S &operator*() { return *s_; }

 private:
  static S &shared() {
    thread_local S s;
    return s;
  }
  static bool &busy() {
    thread_local bool b = false;
    return b;
  }

  S own_;
  S *s_;
  bool owner_;
};

}  // namespace remote_g2
