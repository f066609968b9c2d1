// _extent_copy: copy many (dst, src, nbytes) extents within this process, with the GIL released.
//
// What the gathered READ path moves in host memory: a source rank packs a
// lease's scattered pieces into its staging region (remote_g2/source/gather.py),
// thousands of memcpy calls of a few KiB; a numpy gather of the same pieces
// runs at a quarter of memcpy's rate here, and a Python loop at a fraction of that.
//
// Contract: the three arrays are equally long, one extent per row; every
// address range was checked by the caller against memory this process owns
// (the pool, the staging region, the landing region) — this file trusts them.
// Extents must not overlap one another. The GIL is released for the copy, so
// other threads (a server answering RPCs, a NIXL progress thread) run meanwhile.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
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
  }
  return total;
}

// pack_chunks(dst, src, nbytes, per_block, blocks, chunk_blocks, counter_addr, stop_addr) -> blocks counted.
//
// The gather thread's whole job in one call, the GIL released throughout (a Python loop between chunks
// would wait up to a GIL switch interval, 5 ms, at every chunk while the rank's other threads run): rows
// [k * per_block, (k + 1) * per_block) are block k; blocks are copied chunk_blocks at a time, and after
// each chunk the u64 at counter_addr is set to the blocks copied so far (a release store: a reader that
// sees the count sees the bytes). The u64 at stop_addr is read (acquire) before each chunk and before each
// count: once it is non-zero, nothing more is copied or counted.
uint64_t pack_chunks(U64In dst, U64In src, U64In nbytes, uint64_t per_block, uint64_t blocks, uint64_t chunk_blocks,
                     uint64_t counter_addr, uint64_t stop_addr) {
  const size_t n = dst.shape(0);
  if (src.shape(0) != n || nbytes.shape(0) != n || per_block == 0 || chunk_blocks == 0 || blocks * per_block > n)
    throw std::invalid_argument("pack_chunks: arrays of unequal length, or fewer rows than blocks * per_block");
  if (counter_addr % 8 || stop_addr % 8) throw std::invalid_argument("pack_chunks: unaligned counter or stop word");
  const uint64_t *d = dst.data(), *s = src.data(), *len = nbytes.data();
  auto *counter = reinterpret_cast<uint64_t *>(counter_addr);
  auto *stop = reinterpret_cast<const uint64_t *>(stop_addr);
  uint64_t done = 0;
  nb::gil_scoped_release unlocked;
  while (done < blocks) {
    if (__atomic_load_n(stop, __ATOMIC_ACQUIRE)) break;
    const uint64_t end = std::min(blocks, done + chunk_blocks);
    for (uint64_t i = done * per_block; i < end * per_block; ++i)
      std::memcpy(reinterpret_cast<void *>(d[i]), reinterpret_cast<const void *>(s[i]), size_t(len[i]));
    if (__atomic_load_n(stop, __ATOMIC_ACQUIRE)) break;  // its lease ended during the copy: never count it
    __atomic_store_n(counter, end, __ATOMIC_RELEASE);
    done = end;
  }
  return done;
}

}  // namespace

NB_MODULE(_extent_copy, m) {
  m.doc() = "Private: copy (dst, src, nbytes) extents with the GIL released (remote_g2/memory/extent_copy.py wraps it).";
  m.def("copy_extents", &copy_extents, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"));
  m.def("pack_chunks", &pack_chunks, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::arg("per_block"),
        nb::arg("blocks"), nb::arg("chunk_blocks"), nb::arg("counter_addr"), nb::arg("stop_addr"));
}
