/* st_index_internal.h: what the files of st_index.h share (st_index.c the names, the parser and the set
 * checks; st_set.c the set view; st_index_plan.c the split and the index document; st_set_writer.c the
 * writer), for those files only.  Small helpers, inline so each file keeps its own copy as before. */
#ifndef ST_INDEX_INTERNAL_H
#define ST_INDEX_INTERNAL_H

#include <stddef.h>
#include <string.h>

static inline int bytes_cmp(const char *a, size_t al, const char *b, size_t bl)
{
    int c = memcmp(a, b, al < bl ? al : bl);
    if (c != 0)
        return c;
    return (al > bl) - (al < bl);
}

static inline int ends_with(const char *s, size_t len, const char *suffix, size_t *stem)
{
    size_t sl = strlen(suffix);
    if (len < sl || memcmp(s + len - sl, suffix, sl) != 0)
        return 0;
    *stem = len - sl;
    return 1;
}

static inline const char *file_name_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

#endif
