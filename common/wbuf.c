#include "wbuf.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int wbuf_init(wbuf *b, size_t cap)
{
    memset(b, 0, sizeof(*b));
    b->fill = malloc(cap);
    b->out = malloc(cap);
    if (b->fill == NULL || b->out == NULL) {
        wbuf_free(b);
        return -ENOMEM;
    }
    b->fill_cap = b->out_cap = cap;
    return 0;
}

void wbuf_free(wbuf *b)
{
    free(b->fill);
    free(b->out);
    memset(b, 0, sizeof(*b));
}

size_t wbuf_unit_left(uint64_t off, size_t unit)
{
    return unit - (size_t)(off % unit);
}

size_t wbuf_cut(const wbuf *b, uint64_t off, size_t unit, int all)
{
    size_t left = wbuf_unit_left(off, unit);
    return all || b->fill_len <= left ? b->fill_len : left;
}

int wbuf_append(wbuf *b, const void *p, size_t n)
{
    if (n > b->fill_cap - b->fill_len) {
        size_t nc = b->fill_cap ? b->fill_cap : 4096;
        while (nc - b->fill_len < n)
            nc *= 2;
        char *nb = realloc(b->fill, nc);
        if (nb == NULL)
            return -ENOMEM;
        b->fill = nb;
        b->fill_cap = nc;
    }
    memcpy(b->fill + b->fill_len, p, n);
    b->fill_len += n;
    return 0;
}

int wbuf_swap(wbuf *b, size_t len)
{
    size_t rest = b->fill_len - len, cap = b->out_cap;
    char *next = b->out;

    if (rest > cap) {
        if ((next = realloc(next, rest)) == NULL)
            return -ENOMEM;
        cap = rest;
    }
    memcpy(next, b->fill + len, rest);
    b->out = b->fill;
    b->out_cap = b->fill_cap;
    b->fill = next;
    b->fill_cap = cap;
    b->fill_len = rest;
    return 0;
}
