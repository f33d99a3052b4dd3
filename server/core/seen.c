#include "seen.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <xxhash.h>

/* A seed nobody outside the process knows: the kernel's, else (no entropy yet) the clock and an address. */
static uint64_t random_seed(const void *salt)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof(s), GRND_NONBLOCK) != (ssize_t)sizeof(s) || s == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        s = XXH3_64bits_withSeed(&ts, sizeof(ts), (uint64_t)(uintptr_t)salt) | 1;
    }
    return s;
}

static seen_entry *probe(const seen_map *m, const char *key)
{
    size_t i = (size_t)XXH3_64bits_withSeed(key, strlen(key), m->seed) & (m->cap - 1);
    for (;;) {
        seen_entry *e = &m->slots[i];
        if (e->key == NULL || strcmp(e->key, key) == 0)
            return e;
        i = (i + 1) & (m->cap - 1);
    }
}

static int grow(seen_map *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 64;

    if (m->cap == 0 && m->seed == 0)
        m->seed = random_seed(m);
    seen_map n = {calloc(ncap, sizeof(seen_entry)), ncap, 0, m->seed};

    if (n.slots == NULL)
        return -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->slots[i].key != NULL) {
            *probe(&n, m->slots[i].key) = m->slots[i];
            n.count++;
        }
    }
    free(m->slots);
    *m = n;
    return 0;
}

seen_entry *seen_find(const seen_map *m, const char *key)
{
    if (m->cap == 0)
        return NULL;
    seen_entry *e = probe(m, key);
    return e->key ? e : NULL;
}

seen_entry *seen_get(seen_map *m, const char *key, int *created)
{
    seen_entry *e;

    *created = 0;
    if ((m->count + 1) * 2 > m->cap && grow(m) != 0)
        return NULL;
    e = probe(m, key);
    if (e->key == NULL) {
        memset(e, 0, sizeof(*e));
        if ((e->key = strdup(key)) == NULL)
            return NULL;
        m->count++;
        *created = 1;
    }
    return e;
}

int seen_prune(seen_map *m, int (*keep)(const seen_entry *e, void *arg), void *arg)
{
    size_t kept = 0, ncap = 64;

    for (size_t i = 0; i < m->cap; i++)
        kept += m->slots[i].key != NULL && keep(&m->slots[i], arg);
    if (kept == m->count)
        return 0;
    while (ncap < 2 * (kept + 1))
        ncap *= 2;
    /* open addressing cannot delete in place: the survivors go into a fresh table */
    seen_map n = {calloc(ncap, sizeof(seen_entry)), ncap, 0, m->seed};
    if (n.slots == NULL)
        return -1;
    for (size_t i = 0; i < m->cap; i++) {
        seen_entry *e = &m->slots[i];
        if (e->key == NULL)
            continue;
        if (keep(e, arg)) {
            *probe(&n, e->key) = *e;
            n.count++;
        } else {
            free(e->key);
        }
    }
    free(m->slots);
    *m = n;
    return 0;
}

void seen_free(seen_map *m)
{
    for (size_t i = 0; i < m->cap; i++)
        free(m->slots[i].key);
    free(m->slots);
    memset(m, 0, sizeof(*m));
}
