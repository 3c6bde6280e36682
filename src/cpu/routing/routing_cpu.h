// What the CPU routing oracle shares with the CPU route_backward.
#pragma once

namespace switchyard::cpu {

// The softmax terms of one row of E logits: the max m over its finite logits and the canonical
// denominator (common/routing_math.h: 32 partial sums in ascending e, then the butterfly), so
// that p[e] = exp_f32(s[e] - m) / sum for a finite s[e].
void canonical_softmax_terms(const float* s, int E, float* m, float* sum);

}  // namespace switchyard::cpu
