// _extent_copy: copy many (dst, src, nbytes) extents within this process, with the GIL released.
//
// What the gathered READ path moves in host memory: a source rank packs a
// lease's scattered pieces into its staging region (remote_g2/source/gather.py),
// and a target rank scatters a contiguous landing run into its destination
// blocks (remote_g2/target/landing.py). Both are thousands of memcpy calls of
// a few KiB; a numpy gather of the same pieces runs at a quarter of memcpy's
// rate here, and a Python loop at a fraction of that.
//
// Contract: the three arrays are equally long, one extent per row; every
// address range was checked by the caller against memory this process owns
// (the pool, the staging region, the landing region) — this file trusts them.
// Extents must not overlap one another. The GIL is released for the copy, so
// other threads (a server answering RPCs, a NIXL progress thread) run meanwhile.
// The copy ends with a release fence: a store the caller makes after it (the
// gather's staged-blocks counter) is never seen before the bytes it announces.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace nb = nanobind;

namespace {

using U64In = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// copy_extents(dst, src, nbytes) -> total bytes copied.
uint64_t copy_extents(U64In dst, U64In src, U64In nbytes) {
  const size_t n = dst.shape(0);
  if (src.shape(0) != n || nbytes.shape(0) != n)
    throw std::invalid_argument("copy_extents: dst, src and nbytes must be equally long");
  const uint64_t *d = dst.data(), *s = src.data(), *len = nbytes.data();
  uint64_t total = 0;
  {
    nb::gil_scoped_release unlocked;
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(reinterpret_cast<void *>(d[i]), reinterpret_cast<const void *>(s[i]), size_t(len[i]));
      total += len[i];
    }
    // Whatever the caller stores next (a staged-blocks counter a reader polls) becomes visible only
    // after these bytes: a release fence, free on x86 and needed on weaker orders.
    std::atomic_thread_fence(std::memory_order_release);
  }
  return total;
}

}  // namespace

NB_MODULE(_extent_copy, m) {
  m.doc() = "Private: copy (dst, src, nbytes) extents with the GIL released (remote_g2/extent_copy.py wraps it).";
  m.def("copy_extents", &copy_extents, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"));
}
