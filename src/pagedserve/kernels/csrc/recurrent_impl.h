// Per-(sequence, head) recurrences of recurrent_fp32.cpp, compiled once per ISA region (that
// file's `#pragma GCC target` includes): plain loops whose innermost one runs over contiguous
// values element by element (vectorized by the compiler, no reduction reassociated: with
// -ffp-contract=off the bits do not depend on the vector width).

// Gated delta rule (Gated DeltaNet; Kimi Delta Attention) of one head over `n` tokens: S [K, V]
// in place.
//   S *= decay;  mem = k S;  delta = (v - mem) * beta;  S += k^T delta;  out = q S
// q, k rows of K values, v / out rows of V values, `stride_*` between tokens; mem / delta /
// acc scratch of V values. The decay of key row i is decay[t * sd + i * sdk]: sdk 0, one a head
// (Gated DeltaNet); sdk 1, one per key channel (KDA's diagonal gate).
static void gdr_head(float* S, const float* q, const float* k, const float* v, const float* beta,
                     const float* decay, float* out, int64_t n, int64_t K, int64_t V,
                     int64_t sqk, int64_t sv, int64_t sg, int64_t so, float* mem, float* delta,
                     int64_t sd, int64_t sdk) {
  for (int64_t t = 0; t < n; ++t) {
    const float* qt = q + t * sqk;
    const float* kt = k + t * sqk;
    const float* vt = v + t * sv;
    const float* dt = decay + t * sd;
    const float b = beta[t * sg];
    for (int64_t j = 0; j < V; ++j) mem[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {  // decay, then k S (i ascending)
      float* row = S + i * V;
      const float ki = kt[i], d = dt[i * sdk];
      for (int64_t j = 0; j < V; ++j) {
        const float s = row[j] * d;
        row[j] = s;
        mem[j] = mem[j] + s * ki;
      }
    }
    for (int64_t j = 0; j < V; ++j) delta[j] = (vt[j] - mem[j]) * b;
    float* o = out + t * so;
    for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {  // the rank-1 update, then q S (i ascending)
      float* row = S + i * V;
      const float ki = kt[i], qi = qt[i];
      for (int64_t j = 0; j < V; ++j) {
        const float s = row[j] + ki * delta[j];
        row[j] = s;
        o[j] = o[j] + s * qi;
      }
    }
  }
}

// Selective state space (Mamba 2) of one head over `n` tokens: S [P, N] in place.
//   S = S * exp(dt A) + (dt x) B;  y = S C + D x
// x / y rows of P values, B / C rows of N values (the head's group), dt one value a token.
static void ssm_head(float* S, const float* x, const float* dt, float A, const float* B,
                     const float* C, float D, float* y, int64_t n, int64_t P, int64_t N,
                     int64_t sx, int64_t sdt, int64_t sbc, int64_t sy) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * sx;
    const float* bt = B + t * sbc;
    const float* ct = C + t * sbc;
    const float dtt = dt[t * sdt];
    const float da = std::exp(dtt * A);
    float* yt = y + t * sy;
    for (int64_t p = 0; p < P; ++p) {
      float* row = S + p * N;
      const float dx = dtt * xt[p];
      float acc = 0.0f;
      for (int64_t j = 0; j < N; ++j) {
        const float s = row[j] * da + dx * bt[j];
        row[j] = s;
      }
      for (int64_t j = 0; j < N; ++j) acc = acc + row[j] * ct[j];  // (j ascending: scalar order)
      yt[p] = acc + D * xt[p];
    }
  }
}
