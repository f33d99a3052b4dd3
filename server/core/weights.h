/* weights: weighted_mean's scales (README, "Robust aggregation"), one definition for the single
 * aggregator's pass (server/daemon_robust.c) and a cluster's shards (server/hub/s3_cluster_shard.c), so
 * that both compute the same bits from the same deltas. */
#ifndef DILOCOD_WEIGHTS_H
#define DILOCOD_WEIGHTS_H

#include <stddef.h>

#include "delta.h"

/* A delta's w_k: its weight, else its num_tokens; 0 when it reports neither (it has no say). */
double weights_of(const delta_metrics *m);

/* a_k for the w_k of a round in node order: m the lower median of the positive weights,
 * u_k = min(w_k / m, ratio), a_k = float(u_k / U) with U the sum of the u_k in node order, in double; a
 * round of no positive weight falls back to the mean's 1/n.  0, or -ENOMEM. */
int weights_scales(const double *w, size_t n, double ratio, float *scale);

#endif
