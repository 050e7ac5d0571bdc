// The AMX tile configuration every tile kernel here uses: palette 1, all 8 tiles 16 rows x 64
// bytes. NOTE: no include guard and no system headers: included inside the AMX target regions
// (qlinear_impl.h, prefill_attention.cpp, paged_attention.cpp), after <immintrin.h>, once per
// namespace.

inline void amx_config() {
  alignas(64) uint8_t cfg[64] = {0};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;  // colsb
    cfg[48 + t] = 16;      // rows
  }
  // NOTE: the barrier keeps the stores above: GCC's _tile_loadconfig names only the first 8
  // bytes of cfg as its input, and without it they were dropped as dead (a zero config: the
  // first tile instruction then raised SIGILL).
  __asm__ __volatile__("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

inline void amx_release() { _tile_release(); }
