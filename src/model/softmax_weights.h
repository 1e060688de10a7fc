// Softmax weights of a logits row, for sampling and logprobs on the host: w = e^(s - max) with s a
// (temperature-scaled) logit, and their sum over a row in a fixed order.
//
// Both are exact functions of their inputs, the same on every machine and whichever code path
// asks, because the sampler's fast path and its reference (model/sampler.h) must draw the same
// token from the same row, and a seed must give the same tokens everywhere:
//   - exp_weight: a float exp (Cody-Waite reduction, Cephes' polynomial, relative error ~1e-7)
//     computed with the same IEEE operations as the 4-wide loop of exp_weight_sum, so a lane's
//     result equals the scalar call's bit for bit; no fused multiply-add (ISO C++ for baseline
//     x86-64 has none);
//   - the sums: 8 partial sums in double, partial j adding the weights of ids = j (mod 8) in
//     ascending id order, combined as ((0+1)+(2+3))+((4+5)+(6+7)). A row's pass runs 8 ids a step,
//     a small set one id at a time, and both get the same bits (a masked or underflowing id adds
//     +0, which changes no partial).
// Over Qwen3's 151,936 ids the row sum costs ~0.2 ms on the CI machine's CPU, against ~0.7 ms for
// std::exp in double one id at a time (docs/PERF.md).
#pragma once

#include <span>

namespace moebius::model {

// e^d for d <= 0 (relative error ~1e-7); 0 below d = -87 (where e^d leaves float's normal range)
// and for d = -inf.
float exp_weight(float d);

// ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)): the sums' fixed combination.
double combine_partial_sums(const double (&partials)[8]);

// The sum of exp_weight(logits[i] * scale - mx) over the row (-inf logits add 0), 8 ids a step.
// mx must be at least every scaled logit.
double exp_weight_sum(std::span<const float> logits, float scale, float mx);

}  // namespace moebius::model
