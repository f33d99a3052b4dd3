#include "index_parse.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Bytes the kept parses hold, process-wide: the scan keeps a parse only while this stays within
 * INDEX_PARSE_KEPT_MAX, and the last release gives its bytes back, whichever thread drops it. */
static atomic_size_t kept_total;

/* One malloc'd block of n bytes, as the allocator spends it (its header and rounding, roughly). */
static size_t block(size_t n)
{
    return (n + 16 + 15) & ~(size_t)15;
}

/* What an st_index holds in memory, for the budget. */
static size_t index_bytes(const st_index *ix)
{
    size_t n = block(sizeof(*ix)) + block(strlen(ix->base) + 1) + block(ix->nmeta * sizeof(*ix->meta)) +
               block(ix->nentries * sizeof(*ix->entries)) + block(ix->nentries * sizeof(*ix->by_name));

    for (size_t i = 0; i < ix->nmeta; i++)
        n += block(ix->meta[i].key_len + 1) + block(ix->meta[i].value_len + 1);
    for (size_t i = 0; i < ix->nentries; i++)
        n += block(ix->entries[i].name_len + 1);
    return n;
}

/* Records why p is not a parse (the message and tensor copied: err is the caller's).  0 or -ENOMEM. */
static int set_verdict(index_parse *p, index_parse_status status, const dl_error *err, int incomplete)
{
    p->status = status;
    p->code = err->code;
    p->sys_errno = err->sys_errno;
    p->incomplete = incomplete;
    if ((p->message = strdup(err->message)) == NULL)
        return -ENOMEM;
    if (err->tensor[0] != '\0' && (p->tensor = strdup(err->tensor)) == NULL)
        return -ENOMEM;
    return 0;
}

static index_parse *new_parse(const struct stat *sb)
{
    index_parse *p = calloc(1, sizeof(*p));

    if (p == NULL)
        return NULL;
    fsu_ident_of(sb, &p->ident);
    atomic_init(&p->refs, 1);
    return p;
}

static void free_parse(index_parse *p)
{
    index_parse_drop(p);
    free(p->message);
    free(p->tensor);
    free(p);
}

/* A parse error that is JSON cut short (no closing brace yet) says the writer is still at it
 * (json.dump writes in pieces): worth waiting for, not a malformed index. */
static int cut_short(const char *text, size_t len, const dl_error *err)
{
    while (len > 0 && strchr(" \t\r\n", text[len - 1]) != NULL)
        len--;
    return err->code == DL_E_INVALID_HEADER_DESERIALIZATION && !(len > 0 && text[len - 1] == '}');
}

/* Reads exactly the len bytes sb says the file holds, then checks it is still that version: the
 * bytes parsed are then the version recorded.  0, or the verdict's error (err filled, *incomplete
 * when the writer may still be at it). */
static int read_version(int fd, const struct stat *sb, char *text, size_t len, dl_error *err, int *incomplete)
{
    struct stat after;
    fsu_ident before, now;
    int rc;

    *incomplete = 0;
    if ((rc = fsu_pread_all(fd, text, len, 0)) != 0) {
        *incomplete = rc == -ENODATA;
        return *incomplete ? dl_fail(err, DL_E_IO, NULL, 0, "the index shrank while it was read")
                           : dl_fail_errno(err, -rc, "reading the index");
    }
    if (fstat(fd, &after) != 0)
        return dl_fail_errno(err, errno, "reading the index");
    fsu_ident_of(sb, &before);
    fsu_ident_of(&after, &now);
    if (fsu_ident_compare(&before, &now) != FSU_IDENT_SAME) {
        *incomplete = 1;
        return dl_fail(err, DL_E_IO, NULL, 0, "the index changed while it was read");
    }
    return 0;
}

int index_parse_read(int fd, const struct stat *sb, const char *base, index_parse **out)
{
    index_parse *p = new_parse(sb);
    size_t len = (size_t)sb->st_size;
    dl_error err;
    int rc = 0, incomplete;

    *out = NULL;
    if (p == NULL)
        return -ENOMEM;
    dl_error_clear(&err);
    if ((uint64_t)sb->st_size > ST_INDEX_MAX_BYTES) {
        dl_fail(&err, DL_E_HEADER_TOO_LARGE, NULL, 0, "index of %" PRIu64 " bytes is over the %u-byte cap",
                (uint64_t)sb->st_size, ST_INDEX_MAX_BYTES);
        rc = set_verdict(p, INDEX_UNREAD, &err, 0);
        goto out;
    }
    if ((p->text = malloc(len ? len : 1)) == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    p->len = len;
    if (read_version(fd, sb, p->text, len, &err, &incomplete) != 0) {
        rc = set_verdict(p, INDEX_UNREAD, &err, incomplete);
        goto out;
    }
    if (st_index_parse(p->text, len, base, &p->ix, &err) != 0) {
        int writing = cut_short(p->text, len, &err);
        if (writing)
            dl_fail(&err, DL_E_INVALID_HEADER_DESERIALIZATION, NULL, 0,
                    "the index is not complete yet (%zu bytes of JSON cut short)", len);
        rc = set_verdict(p, INDEX_REFUSED, &err, writing);
        goto out;
    }
    p->status = INDEX_PARSED;
    p->nshards = p->ix->nshards;
    p->bytes = index_bytes(p->ix) + block(len);
out:
    if (p->status != INDEX_PARSED)
        index_parse_drop(p);    /* only a parse keeps its bytes */
    if (rc != 0) {
        free_parse(p);
        return rc;
    }
    *out = p;
    return 0;
}

int index_parse_unopened(const struct stat *sb, int e, index_parse **out)
{
    index_parse *p = new_parse(sb);
    dl_error err;

    *out = NULL;
    if (p == NULL)
        return -ENOMEM;
    dl_error_clear(&err);
    dl_fail_errno(&err, -e, "opening the index");
    if (set_verdict(p, INDEX_UNREAD, &err, e == -ENOENT || e == -EAGAIN) != 0) {
        free_parse(p);
        return -ENOMEM;
    }
    *out = p;
    return 0;
}

int index_parse_is_version(const index_parse *p, const struct stat *sb)
{
    fsu_ident id;

    fsu_ident_of(sb, &id);
    return fsu_ident_compare(&p->ident, &id) == FSU_IDENT_SAME;
}

int index_parse_keep(index_parse *p)
{
    size_t cur = atomic_load(&kept_total);

    if (p->ix == NULL || p->kept)
        return p->kept;
    do {
        if (p->bytes > INDEX_PARSE_KEPT_MAX || cur > INDEX_PARSE_KEPT_MAX - p->bytes) {
            index_parse_drop(p);
            return 0;
        }
    } while (!atomic_compare_exchange_weak(&kept_total, &cur, cur + p->bytes));
    p->kept = 1;
    return 1;
}

void index_parse_drop(index_parse *p)
{
    if (p->kept)
        atomic_fetch_sub(&kept_total, p->bytes);
    p->kept = 0;
    st_index_free(p->ix);
    free(p->text);
    p->ix = NULL;
    p->text = NULL;
    p->len = 0;
    p->bytes = 0;
}

index_parse *index_parse_verdict_of(const index_parse *p)
{
    index_parse *v = calloc(1, sizeof(*v));

    if (v == NULL)
        return NULL;
    v->ident = p->ident;
    v->status = p->status;
    v->nshards = p->nshards;
    v->code = p->code;
    v->sys_errno = p->sys_errno;
    v->incomplete = p->incomplete;
    atomic_init(&v->refs, 1);
    if ((p->message != NULL && (v->message = strdup(p->message)) == NULL) ||
        (p->tensor != NULL && (v->tensor = strdup(p->tensor)) == NULL)) {
        free_parse(v);
        return NULL;
    }
    return v;
}

index_parse *index_parse_ref(index_parse *p)
{
    if (p != NULL)
        atomic_fetch_add(&p->refs, 1);
    return p;
}

void index_parse_release(index_parse *p)
{
    if (p != NULL && atomic_fetch_sub(&p->refs, 1) == 1)
        free_parse(p);
}

void index_parse_error(const index_parse *p, dl_error *err)
{
    /* the tensor was escaped when the error was made: copied as it is */
    dl_error_clear(err);
    err->code = p->code;
    err->sys_errno = p->sys_errno;
    snprintf(err->message, sizeof(err->message), "%s", p->message ? p->message : "");
    snprintf(err->tensor, sizeof(err->tensor), "%s", p->tensor ? p->tensor : "");
}

size_t index_parse_kept_bytes(void)
{
    return atomic_load(&kept_total);
}
