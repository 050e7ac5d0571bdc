// The activation formulas of fp32_invariant_isa.h (fp32_activation: silu, tanh-GELU, sigmoid),
// written on a 16-lane `V` with static zero/set1/add/mul/div/fmadd/fnmadd/clamp/round/pow2:
// lane-wise IEEE operations only, so every `V` (AVX2, AVX-512, csrc/moe_impl.h's one on V16) gives
// the same bits for a value wherever it sits in a tensor. Included inside a namespace that defines
// V (fp32_invariant.cpp's ISA namespaces; csrc/moe_impl.h, which must match fp32_activation bit for
// bit: the MoE experts' activation is that op's).
// No include guard on purpose; nothing here may include headers.

// exp(x), Cephes' single-precision polynomial (about 1 ulp), lane-wise: n = round(x log2 e),
// r = x - n ln 2 (in two parts), exp(r) by a degree-7 polynomial, times 2^n. x is clamped to
// [-87, 88] (2^n stays a normal number); callers only divide by 1 + exp(.), where that is harmless.
inline V exp_v(V x) {
  x = V::clamp(x, -87.0f, 88.0f);
  const V n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  V r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  V p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::add(V::fmadd(p, V::mul(r, r), r), V::set1(1.0f));
  return V::mul(p, V::pow2(n));
}

// silu(x) = x / (1 + exp(-x)); gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3).
inline V act_v(V x, int64_t act) {
  V z;
  if (act == 2) {  // sigmoid: 1 / (1 + exp(-x))
    return V::div(V::set1(1.0f), V::add(V::set1(1.0f), exp_v(V::mul(x, V::set1(-1.0f)))));
  }
  if (act == 0) {
    z = V::mul(x, V::set1(-1.0f));
  } else {
    const V x3 = V::mul(V::mul(x, x), x);
    const V u = V::mul(V::set1(0.7978845608028654f), V::add(x, V::mul(V::set1(0.044715f), x3)));
    z = V::mul(u, V::set1(-2.0f));
  }
  return V::div(x, V::add(V::set1(1.0f), exp_v(z)));
}
