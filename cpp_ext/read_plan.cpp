// _read_plan: the private core of remote_g2.target.tp_mapping's whole-block plans.
//
// When every extent of a head slice is a whole block (homogeneous TP, MLA),
// ReadPlanner.plan maps each matched block to (remote address, local
// address), sorts by remote address and merges neighbours that are adjacent
// on both sides into one descriptor. The contracts live in tp_mapping.py;
// this file says how.
//
// Why C++: a target rank plans right after a message woke it, and on the
// small hosts this runs on code that ran before a sleep runs several times
// slower once after it (bench/diagnostics/bench_wake_cost.py). The cost scales with the
// code run: the numpy path makes ~20 calls, each a trip through the
// interpreter and numpy's dispatch; this is one call over two int lists.
//
// Anything unusual is not this file's to explain: it answers None and the
// caller's numpy path raises the reason (ids that are not a list of plain
// ints, ids out of range, repeated ids). So the two paths cannot disagree on
// what is an error.
//
// Threading: none of its own; every call holds the GIL (it reads Python
// lists) and takes microseconds.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace {

using U64Array = nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>>;

// `o` as block ids: a list of plain ints, each in 0..n-1. False for anything else.
bool read_ids(PyObject *o, uint64_t n, std::vector<uint64_t> &out) {
  if (!PyList_CheckExact(o)) return false;
  Py_ssize_t len = PyList_GET_SIZE(o);
  out.resize(size_t(len));
  for (Py_ssize_t i = 0; i < len; ++i) {
    PyObject *item = PyList_GET_ITEM(o, i);
    if (!PyLong_CheckExact(item)) return false;  // bool, numpy ints, floats: the numpy path decides
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 || v < 0 || uint64_t(v) >= n) return false;
    out[size_t(i)] = uint64_t(v);
  }
  return true;
}

bool distinct(std::vector<uint64_t> ids) {  // a copy: the caller keeps the order
  std::sort(ids.begin(), ids.end());
  return std::adjacent_find(ids.begin(), ids.end()) == ids.end();
}

// ids_ok(ids, num_blocks): whether `ids` is a list of distinct plain ints in 0..num_blocks-1.
bool ids_ok(nb::handle ids, uint64_t num_blocks) {
  std::vector<uint64_t> v;
  return read_ids(ids.ptr(), num_blocks, v) && distinct(std::move(v));
}

// plan_whole_blocks(...) -> (remote, local, nbytes) uint64 arrays, or None (see the file comment).
//
// Block i of the request reads `extent_bytes` from src_base + src_ids[i] *
// src_block_bytes into dst_base + dst_ids[i] * dst_block_bytes; the
// extents come out sorted by remote address, adjacent ones merged.
nb::object plan_whole_blocks(nb::handle src_ids, uint64_t src_base, uint64_t src_block_bytes,
                             uint64_t src_num_blocks, nb::handle dst_ids, uint64_t dst_base,
                             uint64_t dst_block_bytes, uint64_t dst_num_blocks, uint64_t extent_bytes) {
  std::vector<uint64_t> src, dst;
  if (!read_ids(src_ids.ptr(), src_num_blocks, src) || !read_ids(dst_ids.ptr(), dst_num_blocks, dst) ||
      src.size() != dst.size() || !distinct(dst))
    return nb::none();
  const size_t n = src.size();
  std::vector<std::pair<uint64_t, uint64_t>> ext(n);  // (remote, local)
  for (size_t i = 0; i < n; ++i)
    ext[i] = {src_base + src[i] * src_block_bytes, dst_base + dst[i] * dst_block_bytes};
  std::sort(ext.begin(), ext.end());
  for (size_t i = 1; i < n; ++i)  // sorted: a repeated source id sits next to its twin
    if (ext[i].first == ext[i - 1].first) return nb::none();

  // One buffer for the three arrays, freed with the last of them.
  auto *buf = new uint64_t[3 * (n ? n : 1)];
  nb::capsule owner(buf, [](void *p) noexcept { delete[] static_cast<uint64_t *>(p); });
  uint64_t *remote = buf, *local = buf + n, *size = buf + 2 * n;
  size_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    if (m && remote[m - 1] + size[m - 1] == ext[i].first && local[m - 1] + size[m - 1] == ext[i].second) {
      size[m - 1] += extent_bytes;  // adjacent on both sides: one descriptor
      continue;
    }
    remote[m] = ext[i].first;
    local[m] = ext[i].second;
    size[m] = extent_bytes;
    ++m;
  }
  // The merged runs are packed at the front of each third.
  auto array = [&](uint64_t *p) { return U64Array(p, {m}, owner).cast(); };
  return nb::make_tuple(array(remote), array(local), array(size));
}

}  // namespace

NB_MODULE(_read_plan, m) {
  m.doc() = "Private core of remote_g2.target.tp_mapping's whole-block plans; use ReadPlanner from there.";
  m.def("ids_ok", &ids_ok, nb::arg("ids").none(), nb::arg("num_blocks"));
  m.def("plan_whole_blocks", &plan_whole_blocks, nb::arg("src_ids").none(), nb::arg("src_base"),
        nb::arg("src_block_bytes"), nb::arg("src_num_blocks"), nb::arg("dst_ids").none(), nb::arg("dst_base"),
        nb::arg("dst_block_bytes"), nb::arg("dst_num_blocks"), nb::arg("extent_bytes"));
}
