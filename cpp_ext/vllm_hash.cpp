// _vllm_hash: vLLM's chain of block hashes over token ids, in one call (remote_g2/identity/vllm_hashing.py).
//
// vLLM hashes block i as SHA-256 of the encoding of (h_{i-1}, tuple(tokens of block i), extra_i): a pickle
// (protocol 5) for "sha256", canonical CBOR for "sha256_cbor". For these objects — 32 bytes, a tuple of
// ints below 2^31, and extra keys — both encodings are a fixed frame around the token ids, so the chain is
// written here byte for byte without building a Python object per block: the Python path pickles or
// CBOR-encodes ~512 tuples for an 8,192-token prompt and takes about a millisecond; this takes a tenth.
//
// Contract (the caller, remote_g2/identity/vllm_hashing.py, keeps it):
//   * `extra0` / `extra` are the already-encoded extra keys of block 0 and of every later block: in the
//     pickle case the opcodes pickle writes for them inside the outer tuple (b"N" for None), in the CBOR
//     case their CBOR item (0xf6 for None). A pickle's back-references (BINGET n) in them count the outer
//     tuple's memo as this chain writes it: the parent hash is entry 0, the token tuple entry 1 (the caller
//     pickles the keys inside such a tuple and cuts them out).
//   * a pickle body stays under pickle's 64 KiB frame target (the caller falls back to pickle itself
//     otherwise): then pickle writes the whole body as one frame.
// Token ids must be Python ints in [0, 2^31): anything else raises ValueError and nothing is returned.
// The GIL is held while the ids are read, released while hashing.
//
// Also here, for the scoring API's request bodies: parse_ids (a JSON array of token ids, read without a
// Python int per token) and split_ids (that array cut out of a body, so the JSON decoder reads only the
// rest). Both read digits a machine word at a time, which assumes a little-endian CPU (checked below).

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;

namespace {

// ---- SHA-256 (FIPS 180-4), portable ---------------------------------------------------------------

constexpr uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t s[8], const uint8_t *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  s[0] += a; s[1] += b; s[2] += c; s[3] += d; s[4] += e; s[5] += f; s[6] += g; s[7] += h;
}

#if defined(__x86_64__) || defined(__i386__)
// ---- SHA-256 with the x86 SHA extensions (SHA-NI), chosen at run time where the CPU has them ------
// The rounds are the SHA-NI instructions' standard schedule: four rounds per step, the message words
// extended by sha256msg1/msg2 four at a time; the state is kept as (ABEF, CDGH) as sha256rnds2 wants it.

__attribute__((target("sha,sse4.1,ssse3"))) void compress_shani(uint32_t s[8], const uint8_t *p, size_t blocks) {
  const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s)), 0xB1);     // CDAB
  __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + 4)), 0x1B);  // EFGH
  __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);     // ABEF
  st1 = _mm_blend_epi16(st1, tmp, 0xF0);          // CDGH
  for (; blocks; --blocks, p += 64) {
    const __m128i save0 = st0, save1 = st1;
    __m128i m[4];
#pragma GCC unroll 16  // unrolled, m[] lives in registers: a quarter faster than the loop (GCC 12, Zen)
    for (int i = 0; i < 16; ++i) {
      __m128i &cur = m[i % 4], &next = m[(i + 1) % 4], &prev = m[(i + 3) % 4];
      if (i < 4) cur = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16 * i)), mask);
      __m128i msg = _mm_add_epi32(cur, _mm_loadu_si128(reinterpret_cast<const __m128i *>(K + 4 * i)));
      st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
      if (i >= 3 && i <= 14) next = _mm_sha256msg2_epu32(_mm_add_epi32(next, _mm_alignr_epi8(cur, prev, 4)), cur);
      st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(msg, 0x0E));
      if (i >= 1 && i <= 12) prev = _mm_sha256msg1_epu32(prev, cur);
    }
    st0 = _mm_add_epi32(st0, save0);
    st1 = _mm_add_epi32(st1, save1);
  }
  tmp = _mm_shuffle_epi32(st0, 0x1B);             // FEBA
  st1 = _mm_shuffle_epi32(st1, 0xB1);             // DCHG
  _mm_storeu_si128(reinterpret_cast<__m128i *>(s), _mm_blend_epi16(tmp, st1, 0xF0));   // DCBA
  _mm_storeu_si128(reinterpret_cast<__m128i *>(s + 4), _mm_alignr_epi8(st1, tmp, 8));  // HGFE
}

bool cpu_has_sha() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9))) return false;  // SSE4.1, SSSE3
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return b & (1u << 29);  // SHA
}
#else
void compress_shani(uint32_t *, const uint8_t *, size_t) {}
bool cpu_has_sha() { return false; }
#endif

bool g_shani = cpu_has_sha();  // set_portable(True) turns it off (tests hold both paths to hashlib)

// SHA-256 of msg[0, n) into out[32]; msg must have room for the padding (n + 72 bytes).
void sha256(uint8_t *msg, size_t n, uint8_t out[32]) {
  uint32_t s[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t padded = (n + 9 + 63) / 64 * 64;
  msg[n] = 0x80;
  std::memset(msg + n + 1, 0, padded - n - 9);
  uint64_t bits = uint64_t(n) * 8;
  for (int i = 0; i < 8; ++i) msg[padded - 1 - i] = uint8_t(bits >> (8 * i));
  if (g_shani)
    compress_shani(s, msg, padded / 64);
  else
    for (size_t off = 0; off < padded; off += 64) compress(s, msg + off);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(s[i] >> 24); out[4 * i + 1] = uint8_t(s[i] >> 16);
    out[4 * i + 2] = uint8_t(s[i] >> 8); out[4 * i + 3] = uint8_t(s[i]);
  }
}

// ---- the encodings -------------------------------------------------------------------------------

// A token id's pickle opcode (BININT1 'K', BININT2 'M', BININT 'J') at w; returns the end.
inline uint8_t *put_pickle_int(uint8_t *w, uint32_t t) {
  if (t < 256) { w[0] = 'K'; w[1] = uint8_t(t); return w + 2; }
  if (t < 65536) { w[0] = 'M'; w[1] = uint8_t(t); w[2] = uint8_t(t >> 8); return w + 3; }
  w[0] = 'J';  // little-endian, as pickle writes it (one store where the CPU is little-endian too)
  w[1] = uint8_t(t); w[2] = uint8_t(t >> 8); w[3] = uint8_t(t >> 16); w[4] = uint8_t(t >> 24);
  return w + 5;
}

// A CBOR head (major type, argument) at w, shortest form as canonical CBOR wants; returns the end.
inline uint8_t *put_cbor_head(uint8_t *w, uint8_t major, uint64_t n) {
  major <<= 5;
  if (n < 24) { *w = uint8_t(major | n); return w + 1; }
  if (n < 256) { w[0] = uint8_t(major | 24); w[1] = uint8_t(n); return w + 2; }
  if (n < 65536) { w[0] = uint8_t(major | 25); w[1] = uint8_t(n >> 8); w[2] = uint8_t(n); return w + 3; }
  w[0] = uint8_t(major | 26);
  for (int i = 0; i < 4; ++i) w[1 + i] = uint8_t(n >> (8 * (3 - i)));
  return w + 5;
}

constexpr uint32_t kMaxId = 0x7fffffff;

// Token ids [first, first + count) out of a list/tuple of Python ints, or a buffer of native uint32
// (array('I'), as parse_ids makes), clipped to what there is; each must be in [0, kMaxId].
std::vector<uint32_t> read_ids(nb::handle tokens, size_t first, size_t count) {
  std::vector<uint32_t> ids;
  if (PyObject_CheckBuffer(tokens.ptr())) {
    Py_buffer view;
    if (PyObject_GetBuffer(tokens.ptr(), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
    bool u32 = view.itemsize == 4 && view.format && (std::strcmp(view.format, "I") == 0 || std::strcmp(view.format, "=I") == 0 ||
                                                     std::strcmp(view.format, "<I") == 0 || std::strcmp(view.format, "L") == 0);
    if (u32) {
      const size_t have = size_t(view.len) / 4, from = std::min(first, have);
      ids.resize(std::min(count, have - from));
      std::memcpy(ids.data(), static_cast<const uint32_t *>(view.buf) + from, ids.size() * 4);
    }
    PyBuffer_Release(&view);
    if (!u32) throw std::invalid_argument("a token buffer must hold uint32 items");
    for (uint32_t v : ids)
      if (v > kMaxId) throw std::invalid_argument("token ids must be ints in [0, 2**31 - 1]");
    return ids;
  }
  PyObject *seq = PySequence_Fast(tokens.ptr(), "token ids must be a sequence");
  if (!seq) throw nb::python_error();
  const size_t have = size_t(PySequence_Fast_GET_SIZE(seq)), from = std::min(first, have);
  PyObject **items = PySequence_Fast_ITEMS(seq) + from;
  ids.resize(std::min(count, have - from));
  for (size_t i = 0; i < ids.size(); ++i) {
    PyObject *o = items[i];
    long v = PyLong_CheckExact(o) ? PyLong_AsLong(o) : -1;  // exact ints only: no bool, no float
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    if (v < 0 || v > long(kMaxId)) {
      Py_DECREF(seq);
      throw std::invalid_argument("token ids must be ints in [0, 2**31 - 1]");
    }
    ids[i] = uint32_t(v);
  }
  Py_DECREF(seq);
  return ids;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "digits8 and value8 read text as little-endian words");

// The number of ASCII digits at p (up to 8), read as one little-endian word: a byte is a digit iff its high
// nibble is 3 and, plus 6, still 3. (A carry out of a byte >= 0xfa only disturbs bytes after it, past the
// first non-digit.) p must have 8 readable bytes.
inline unsigned digits8(const char *p, uint64_t &word) {
  std::memcpy(&word, p, 8);
  const uint64_t hi = 0xF0F0F0F0F0F0F0F0ULL, threes = 0x3333333333333333ULL & hi;
  const uint64_t bad = ((word & hi) ^ threes) | (((word + 0x0606060606060606ULL) & hi) ^ threes);
  return bad ? unsigned(__builtin_ctzll(bad)) / 8 : 8;
}

// The value of the n (1..8) digits at the low end of `word` (as digits8 loaded them): right-aligned behind
// '0's into eight digits, then three multiply-and-add steps, pairs of digits, then fours, then eight.
inline uint32_t value8(uint64_t word, unsigned n) {
  const unsigned shift = 8 * (8 - n);
  if (shift) word = (word << shift) | (0x3030303030303030ULL >> (64 - shift));
  word -= 0x3030303030303030ULL;
  word = word * 10 + (word >> 8);
  const uint64_t mask = 0x000000FF000000FFULL;
  word = ((word & mask) * (100 + (1000000ULL << 32)) + ((word >> 16) & mask) * (1 + (10000ULL << 32))) >> 32;
  return uint32_t(word);
}

// A copy of a Python buffer with 16 NULs after it: digits8 may read 8 bytes anywhere in it, and '\0' ends
// every scanning loop below (it is no digit, no space, no bracket, no quote).
std::string padded_copy(nb::handle obj) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
  std::string text(size_t(view.len) + 16, '\0');
  std::memcpy(&text[0], view.buf, size_t(view.len));
  PyBuffer_Release(&view);
  return text;
}

inline void skip_ws(const char *&p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') ++p;
}

// The JSON array of token ids at p (a padded_copy) into ids[] (room for one per two characters); p is left
// after its ']'. Throws invalid_argument naming the offset from `begin` for anything but ints in [0, kMaxId].
size_t parse_id_array(const char *&p, const char *begin, uint32_t *ids) {
  auto fail = [&](const char *what) {
    throw std::invalid_argument(std::string("token_ids: ") + what + " at offset " + std::to_string(p - begin));
  };
  size_t n = 0;
  skip_ws(p);
  if (*p != '[') fail("expected an array");
  ++p;
  skip_ws(p);
  if (*p == ']') {
    ++p;
    return 0;
  }
  for (;;) {
    skip_ws(p);
    uint64_t word;
    unsigned len = digits8(p, word);
    if (len == 0) fail("expected a non-negative integer");
    if (*p == '0' && len > 1) fail("a leading zero");
    uint64_t v = value8(word, len);
    if (len == 8) {  // (maybe more: at most two more digits fit under 2**31)
      const char *q = p + 8;
      while (unsigned(*q - '0') <= 9 && q - p < 11) v = v * 10 + unsigned(*q++ - '0');
      len = unsigned(q - p);
    }
    if (len > 10 || v > kMaxId) fail("a token id over 2**31 - 1");
    p += len;
    if (*p == '.' || *p == 'e' || *p == 'E') fail("a number that is not an integer");
    ids[n++] = uint32_t(v);
    skip_ws(p);
    if (*p == ',') { ++p; continue; }
    if (*p == ']') { ++p; return n; }
    fail("expected ',' or ']'");
  }
}

// parse_ids(raw) -> bytes of native uint32: a JSON array of ints in [0, kMaxId], as the raw text of the
// scoring API's "token_ids" (RFC 8259 numbers without fraction or exponent; "-0" is refused with every other
// negative). `raw` is any contiguous byte buffer (bytes; msgspec.Raw). ValueError, naming the offset, for
// anything else. Saves a Python int per token; each number's digits are found and valued a word at a time
// (a token id has up to ten digits).
nb::bytes parse_ids(nb::handle raw) {
  const std::string text = padded_copy(raw);
  const char *const begin = text.c_str(), *p = begin, *const end = begin + text.size() - 16;
  std::unique_ptr<uint32_t[]> ids(new uint32_t[size_t(end - begin) / 2 + 1]);  // at most one per two characters
  size_t n = parse_id_array(p, begin, ids.get());
  skip_ws(p);
  if (p != end) throw std::invalid_argument("token_ids: trailing characters at offset " + std::to_string(p - begin));
  return nb::bytes(reinterpret_cast<const char *>(ids.get()), n * 4);
}

// Past one JSON value at p, found by its structure only (strings and nesting; nothing is validated: the
// caller's JSON decoder reads whatever this skips). False where the structure ends early.
bool skip_value(const char *&p, const char *end) {
  auto skip_string = [&]() -> bool {  // p at the opening quote
    for (++p; *p != '"'; ++p) {
      if (p >= end) return false;
      if (*p == '\\') ++p;
    }
    ++p;
    return p <= end;
  };
  if (*p == '"') return skip_string();
  if (*p == '[' || *p == '{') {
    int depth = 0;
    while (p < end) {
      const char c = *p;
      if (c == '"') {
        if (!skip_string()) return false;
        continue;
      }
      if (c == '[' || c == '{') ++depth;
      else if ((c == ']' || c == '}') && --depth == 0) { ++p; return true; }
      ++p;
    }
    return false;
  }
  const char *start = p;
  while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') ++p;
  return p > start;
}

// split_ids(body) -> (ids as bytes of native uint32, the body with that array replaced by null), or None.
//
// The scoring API's bodies are a few short members and one long "token_ids" array. A JSON decoder that
// must also find that array's end reads all of it once more, so the array is cut out here and the rest
// (tens of bytes) is left to the decoder. Only the plain case is taken: a JSON object at the top whose
// member keys carry no escapes, with exactly one "token_ids", an array of valid ids. Anything else gives
// None, and the caller decodes the whole body as before (with the same errors). The cut is where the
// object's structure says the member's value is; the decoder then reads every byte outside it, so a body
// malformed elsewhere is still refused.
nb::object split_ids(nb::handle body) {
  const std::string text = padded_copy(body);
  const char *const begin = text.c_str(), *p = begin, *const end = begin + text.size() - 16;
  std::unique_ptr<uint32_t[]> ids;
  size_t n = 0;
  const char *cut = nullptr, *cut_end = nullptr;
  skip_ws(p);
  if (*p != '{') return nb::none();
  ++p;
  skip_ws(p);
  if (*p == '}') return nb::none();
  for (;;) {
    if (*p != '"') return nb::none();
    const char *key = ++p;
    for (; *p != '"'; ++p)
      if (*p == '\\' || (unsigned char)(*p) < 0x20) return nb::none();  // escapes, controls, NUL, the end
    const bool is_ids = p - key == 9 && std::memcmp(key, "token_ids", 9) == 0;
    ++p;
    skip_ws(p);
    if (*p != ':') return nb::none();
    ++p;
    skip_ws(p);
    if (is_ids) {
      if (cut != nullptr || *p != '[') return nb::none();
      cut = p;
      ids.reset(new uint32_t[size_t(end - p) / 2 + 1]);
      try {
        n = parse_id_array(p, begin, ids.get());
      } catch (const std::invalid_argument &) {
        return nb::none();  // the caller's own path names the error
      }
      cut_end = p;
    } else if (!skip_value(p, end)) {
      return nb::none();
    }
    skip_ws(p);
    if (*p == ',') {
      ++p;
      skip_ws(p);
      continue;
    }
    if (*p != '}') return nb::none();
    ++p;
    break;
  }
  skip_ws(p);
  if (p != end || cut == nullptr) return nb::none();
  std::string rest;
  rest.reserve(size_t(cut - begin) + 4 + size_t(end - cut_end));
  rest.append(begin, cut).append("null").append(cut_end, end);
  return nb::make_tuple(nb::bytes(reinterpret_cast<const char *>(ids.get()), n * 4),
                        nb::bytes(rest.data(), rest.size()));
}

// chain(parent, tokens, block_size, max_blocks, cbor, extra0, extra, start) -> list of 32-byte hashes: the
// hashes of blocks start, start + 1, ... (at most max_blocks), `parent` being block start - 1's (the seed's
// hash for start 0) and `extra0` the extra keys of the first block hashed here.
nb::list chain(nb::bytes parent, nb::handle tokens, size_t block_size, size_t max_blocks, bool cbor,
               nb::bytes extra0, nb::bytes extra, size_t start) {
  if (parent.size() != 32) throw std::invalid_argument("parent must be 32 bytes");
  if (block_size == 0 || block_size > (size_t(1) << 20)) throw std::invalid_argument("block_size out of range");
  if (start > (size_t(1) << 40) / block_size || max_blocks > (size_t(1) << 40) / block_size)
    throw std::invalid_argument("start or max_blocks out of range");
  std::vector<uint32_t> ids = read_ids(tokens, start * block_size, max_blocks * block_size);
  const size_t blocks = std::min(ids.size() / block_size, max_blocks);
  std::string e0(extra0.c_str(), extra0.size()), e1(extra.c_str(), extra.size());
  std::vector<uint8_t> out(blocks * 32);
  {
    nb::gil_scoped_release unlocked;
    // What goes between the parent hash and the token ids, and after them, is the same in every block.
    uint8_t head[8], tail[2];
    size_t head_n, tail_n = 0;
    if (cbor) {
      head_n = size_t(put_cbor_head(head, 4, block_size) - head);
    } else {
      head[0] = 0x94;  // MEMOIZE (the parent), then MARK for a tuple over 3 items
      head_n = block_size > 3 ? 2 : 1;
      head[1] = '(';
      tail[0] = block_size > 3 ? 't' : block_size == 3 ? 0x87 : block_size == 2 ? 0x86 : 0x85;
      tail[1] = 0x94;
      tail_n = 2;
    }
    std::vector<uint8_t> msg(16 + 32 + head_n + 5 * block_size + tail_n + std::max(e0.size(), e1.size()) + 8 + 72);
    uint8_t *const body = msg.data() + (cbor ? 3 : 13);  // where the parent hash goes
    if (cbor) std::memcpy(msg.data(), "\x83\x58\x20", 3);  // [parent bytes(32), [ints], extra]
    else std::memcpy(msg.data(), "\x80\x05\x95\0\0\0\0\0\0\0\0C ", 13);  // PROTO 5, FRAME <len>, SHORT_BINBYTES 32
    std::memcpy(body, parent.c_str(), 32);
    std::memcpy(body + 32, head, head_n);
    const uint32_t *tok = ids.data();
    for (size_t i = 0; i < blocks; ++i) {
      const std::string &e = i == 0 ? e0 : e1;
      uint8_t *w = body + 32 + head_n;
      if (cbor)
        for (size_t j = 0; j < block_size; ++j) w = put_cbor_head(w, 0, *tok++);
      else
        for (size_t j = 0; j < block_size; ++j) w = put_pickle_int(w, *tok++);
      std::memcpy(w, tail, tail_n);
      w += tail_n;
      std::memcpy(w, e.data(), e.size());
      w += e.size();
      if (!cbor) {  // TUPLE3 MEMOIZE STOP, and the frame's length: what follows FRAME <len>, STOP included
        std::memcpy(w, "\x87\x94.", 3);
        w += 3;
        const uint64_t len = uint64_t(w - (msg.data() + 11));
        for (int k = 0; k < 8; ++k) msg[3 + k] = uint8_t(len >> (8 * k));
      }
      sha256(msg.data(), size_t(w - msg.data()), body);  // the next block's parent, in place
      std::memcpy(out.data() + 32 * i, body, 32);
    }
  }
  PyObject *result = PyList_New(Py_ssize_t(blocks));
  if (!result) throw nb::python_error();
  for (size_t i = 0; i < blocks; ++i) {
    PyObject *h = PyBytes_FromStringAndSize(reinterpret_cast<const char *>(out.data() + 32 * i), 32);
    if (!h) { Py_DECREF(result); throw nb::python_error(); }
    PyList_SET_ITEM(result, Py_ssize_t(i), h);
  }
  return nb::steal<nb::list>(result);
}

}  // namespace

NB_MODULE(_vllm_hash, m) {
  m.doc() = "vLLM's chain of block hashes over token ids (remote_g2/identity/vllm_hashing.py)";
  m.def("accelerated", [] { return g_shani; }, "whether SHA-256 runs on the CPU's SHA extensions");
  m.def("set_portable", [](bool portable) { g_shani = !portable && cpu_has_sha(); },
        "tests: force the portable SHA-256 (True), or the CPU's extensions where present (False)");
  m.def("parse_ids", &parse_ids, nb::arg("raw"));
  m.def("split_ids", &split_ids, nb::arg("body"));
  m.def("chain", &chain, nb::arg("parent"), nb::arg("tokens"), nb::arg("block_size"), nb::arg("max_blocks"),
        nb::arg("cbor"), nb::arg("extra0"), nb::arg("extra"), nb::arg("start") = 0);
}
