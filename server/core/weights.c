/* weights: see weights.h. */
#include "weights.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double weights_of(const delta_metrics *m)
{
    if (m->have & DELTA_M_WEIGHT)
        return m->weight;
    if (m->have & DELTA_M_NUM_TOKENS)
        return (double)m->num_tokens;
    return 0;
}

/* A worker's weight is its own claim: uncapped, one weight of 1e308 gave its delta scale 1 and every honest
 * one 0, and two of them summed to inf and committed a zero step.  Capped at ratio times the median (which a
 * minority cannot move out of the honest weights), each u_k is at most ratio, so U is at most ratio x the
 * deltas' count: finite, and at least 1 (the median's own u).  Weights are taken in units of m so that no
 * sum of finite ones overflows. */
int weights_scales(const double *w, size_t n, double ratio, float *scale)
{
    double *v = malloc((n ? n : 1) * sizeof(*v)), m = 0, total = 0;
    size_t nv = 0;

    if (v == NULL)
        return -ENOMEM;
    for (size_t k = 0; k < n; k++)
        if (w[k] > 0)
            v[nv++] = w[k];
    if (nv > 0) {
        qsort(v, nv, sizeof(*v), cmp_double);
        m = v[(nv - 1) / 2];
    }
    for (size_t k = 0; k < n; k++) {
        /* w / m is +inf for a huge weight over a tiny median: fmin caps it at ratio all the same */
        v[k] = nv > 0 && w[k] > 0 ? fmin(w[k] / m, ratio) : 0;
        total += v[k];
    }
    for (size_t k = 0; k < n; k++)
        scale[k] = total > 0 ? (float)(v[k] / total) : (float)(1.0 / (double)n);
    free(v);
    return 0;
}
